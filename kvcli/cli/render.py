"""Presentation: every result the CLI prints on stdout, as text or tables, from plain dictionaries.

The library returns numbers; this module alone decides how they read. Tables are Rich tables
rendered to plain text (no colour), so stdout stays pipe-friendly.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from kvcli.io.report import mib
from kvcli.models.presets import OTHER_KEYS


def _console(buffer: io.StringIO, width: int = 120) -> Console:
    return Console(file=buffer, width=width, force_terminal=False, color_system=None, highlight=False)


def ppl_summary(result: dict) -> str:
    """``kvcli ppl``'s text result: perplexity, the run's settings, memory and speed, one line per document."""
    lines = []
    if result.get("interrupted"):
        lines.append("interrupted: results so far")
    lines.append(f"perplexity {result['ppl']:.3f}  (nll {result['nll']:.4f} nats/token, "
                 f"{result['bits_per_byte']:.4f} bits/byte) over {result['tokens']:,} tokens")
    cache = "unbounded" if result["cache"] is None else f"{result['cache']:,} tokens/layer"
    bits = f" · {result['kv_bits']}-bit KV" if result.get("kv_bits", 16) != 16 else ""
    lines.append(f"{result['model']} · {result['method']} · cache {cache}{bits} · block {result['block']} · "
                 f"{result['protocol']}")
    full = result["full_kv_cache_bytes"]
    share = f"{result['kv_cache_bytes'] / full:.1%} of " if full else ""
    lines.append(f"KV cache {mib(result['kv_cache_bytes'])} ({share}an uncompressed cache of the same tokens: "
                 f"{mib(full)}) · peak memory {mib(result['peak_memory_bytes'])}")
    lines.append(f"{result['seconds']:.1f} s · {result['tokens_per_second']:,.0f} tokens/s on "
                 f"{result['device']} ({result['dtype']})")
    job = result.get("job")
    if job and (job["documents"] > 1 or job["ranks"] > 1 or job["resumed"]):
        resumed = f" ({job['resumed']:,} resumed from --rows)" if job["resumed"] else ""
        lines.append(f"job: {job['documents']:,} documents{resumed} on {job['ranks']} rank"
                     f"{'s' if job['ranks'] > 1 else ''} in {job['seconds']:.1f} s · "
                     f"{job['documents_per_second']:.3f} documents/s · {job['tokens_per_second']:,.0f} tokens/s")
    if "kl_mean" in result:
        lines.append(f"KL divergence vs {Path(result['kl_base']).name}: mean {result['kl_mean']:.4f} nats/token, "
                     f"99th percentile {result['kl_p99']:.4f} · same top token {result['same_top']:.1%} over "
                     f"{result['kl_tokens']:,} tokens")
    if "saved_logits" in result:
        lines.append(f"reference saved to {result['saved_logits']}")
    for row in result.get("documents", []):
        if "skipped" in row:
            lines.append(f"  {row['name']}: skipped ({row['skipped']})")
        else:
            lines.append(f"  {row['name']}: ppl {row['ppl']:.3f} over {row['tokens']:,} tokens")
    return "\n".join(lines)


def methods_listing(rows: list[dict]) -> str:
    """``kvcli methods``: each method, its description and its ``-o`` parameters."""
    lines = []
    for row in rows:
        lines.append(f"{row['name']:<14} {row['description']}")
        for p in row["params"]:
            lines.append(f"{'':<16}-o {p['name']}={p['default']}  {p['help']}")
    return "\n".join(lines)


def models_listing(families: list, presets: dict[str, list[str]]) -> str:
    """``kvcli models``: each supported family, its RoPE, its windows, its attention features and the
    model presets of that family (``presets`` maps a model_type to preset names)."""
    lines = []
    for f in families:
        lines.append(f"{f.model_type:<14} {f.models}")
        lines.append(f"{'':<16}RoPE: {f.rope}")
        lines.append(f"{'':<16}windows: {f.windows}")
        if f.attention:
            lines.append(f"{'':<16}attention: {f.attention}")
        if presets.get(f.model_type):
            lines.append(f"{'':<16}presets: {', '.join(presets[f.model_type])}")
    lines.append("Other models with rotary position embeddings in transformers' layout are read the same way; "
                 "models without RoPE (GPT-2, state-space models) are refused.")
    return "\n".join(lines)


def presets_listing(found: list, user_dir: Path) -> str:
    """``kvcli presets``: presets by kind with their settings and files."""
    lines = []
    for kind in ("model", "method", "mixed"):
        group = [p for p in found if p.kind == kind]
        if not group:
            continue
        lines.append(f"{kind} presets:")
        for p in group:
            settings = ", ".join(f"{k}={_short(v)}" for k, v in p.settings.items() if k not in OTHER_KEYS)
            lines.append(f"  {p.name:<24} {settings}")
            lines.append(f"  {'':<24} {p.source}: {p.path}")
    lines.append(f"user presets folder: {user_dir}")
    return "\n".join(lines)


def cache_listing(entries: list, folder: Path) -> str:
    """``kvcli cache``: each converted model (:class:`kvcli.models.cache.Entry`) with its size and source, then the
    folder and the total."""
    lines = []
    for entry in entries:
        manifest = entry.manifest or {}
        variant = manifest.get("variant") or {}
        state = f"  ({entry.problem}: rebuilt on next use)" if entry.problem else ""
        lines.append(f"{entry.name}  {mib(entry.bytes)}{state}")
        source = (manifest.get("source") or {}).get("path")
        if source:
            made = ", ".join(f"{k} {v}" for k, v in variant.items())
            lines.append(f"  from {source}" + (f" ({made})" if made else ""))
    total = sum(entry.bytes for entry in entries)
    count = f"{len(entries)} cached model{'' if len(entries) == 1 else 's'}"
    lines.append(f"{count}, {mib(total)} in {folder} (KVCLI_CACHE moves it; `kvcli cache clear` empties it)")
    return "\n".join(lines)


def _short(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={v}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def reading_summary(gen, loaded, method: str, budget: int | None, block: int, peak: int) -> str:
    """What ``summarize`` and ``ask`` report on stderr after writing."""
    mode = "one shot" if gen.one_shot else f"streamed in blocks of {block}"
    if getattr(gen, "sections", 0):
        mode = f"in {gen.sections} sections, summarized one by one"
    cache_text = "unbounded" if budget is None else f"{budget:,} tokens/layer"
    return (f"read {gen.prompt_tokens:,} prompt tokens ({mode}) in {gen.read_seconds:.1f} s · generated "
            f"{gen.generated_tokens:,} tokens in {gen.write_seconds:.1f} s ({gen.finish_reason})\n"
            f"{loaded.name} · {method} · cache {cache_text} · max cache {gen.max_cache_tokens:,} tokens · "
            f"KV cache {mib(gen.kv_cache_bytes)} · peak memory {mib(peak)}")


def needle_tables(result, model_name: str) -> str:
    """The grid as two Rich tables rendered to text: accuracy per method x length, then per depth, each
    rate with its 95% Wilson interval."""
    buffer = io.StringIO()
    console = _console(buffer)
    settings = result.settings
    rows = result.accuracy()
    lengths = list(dict.fromkeys(r["length"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["length"]): r for r in rows}
    table = Table(title="pass-key accuracy", caption=f"{model_name} · cache {settings['cache']:,} · block "
                                                        f"{settings['block']} · seed {settings['seed']}")
    table.add_column("method")
    for length in lengths:
        table.add_column(f"{length:,} tokens", justify="right")
    for name in methods:
        table.add_row(name, *(_fmt(cell.get((name, length))) for length in lengths))
    console.print(table)
    deep = result.accuracy(by_depth=True)
    depths = list(dict.fromkeys(r["depth"] for r in deep))
    cell = {(r["method"], r["length"], r["depth"]): r for r in deep}
    table = Table(title="by depth of the needle")
    table.add_column("method")
    table.add_column("length", justify="right")
    for depth in depths:
        table.add_column(f"{depth:.0%}", justify="right")
    for name in methods:
        for length in lengths:
            table.add_row(name, f"{length:,}", *(_fmt(cell.get((name, length, d))) for d in depths))
    console.print(table)
    return buffer.getvalue()


def _fmt(row: dict | None) -> str:
    if row is None:
        return "-"
    low, high = row["ci95"]
    return f"{row['accuracy']:.0%} ({row['correct']}/{row['trials']}, 95% CI {low:.0%}-{high:.0%})"


def bench_table(runs: list[dict], settings: dict, interrupted: bool = False, markdown: bool = False) -> str:
    """The grid's runs as a Rich table rendered to plain text (what the text mode prints on stdout);
    ``markdown`` draws it as a Markdown table under its caption, ready to paste into docs."""
    buffer = io.StringIO()
    console = _console(buffer, width=160)  # the KL columns do not fit in 120 without wrapping headers
    full = next((run for run in runs if run["cache"] is None and run.get("kv_bits", 16) == 16), None)
    bits = any(run.get("kv_bits", 16) != 16 for run in runs)
    source = Path(settings["source"]).name or settings["source"]
    uncompressed = runs[0]["full_kv_cache_bytes"] if runs else 0
    title = "kvcli bench" + (" (interrupted: finished runs only)" if interrupted else "")
    caption = (f"{settings['model']} · {settings['tokens']:,} tokens of {source} · block {settings['block']} · "
               f"{settings['device']} ({settings['dtype']}) · uncompressed KV cache {mib(uncompressed)}")
    if markdown:
        table = Table(box=box.MARKDOWN)
        console.print(caption + "\n", soft_wrap=True)
    else:
        table = Table(title=title, caption=caption)
    table.add_column("method")
    table.add_column("cache", justify="right")
    if bits:
        table.add_column("bits", justify="right")
    table.add_column("perplexity", justify="right")
    if full is not None:
        table.add_column("vs full", justify="right")
    table.add_column("bits/byte", justify="right")
    kl = any("kl_mean" in run for run in runs)
    if kl:
        table.add_column("KL vs full", justify="right")
        table.add_column("KL p99", justify="right")
        table.add_column("same top", justify="right")
    table.add_column("tokens/s", justify="right")
    table.add_column("KV cache", justify="right")
    table.add_column("peak memory", justify="right")
    for run in runs:
        cells = [run["method"], "-" if run["cache"] is None else f"{run['cache']:,}"]
        cells += [str(run.get("kv_bits", 16))] if bits else []
        cells.append(f"{run['ppl']:.3f}")
        if full is not None:
            cells.append("-" if run is full else f"{run['ppl'] / full['ppl'] - 1:+.1%}")
        share = run["kv_cache_bytes"] / run["full_kv_cache_bytes"] if run["full_kv_cache_bytes"] else float("nan")
        cells.append(f"{run['bits_per_byte']:.4f}")
        if kl:
            cells += ([f"{run['kl_mean']:.4f}", f"{run['kl_p99']:.4f}", f"{run['same_top']:.1%}"]
                      if "kl_mean" in run else ["-"] * 3)
        cells += [f"{run['tokens_per_second']:,.0f}",
                  f"{mib(run['kv_cache_bytes'])} ({share:.0%})", mib(run["peak_memory_bytes"])]
        table.add_row(*cells)
    if not runs:
        console.print("no run finished")
    else:
        console.print(table)
    text = buffer.getvalue()
    if not markdown:
        return text
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    return "\n".join(line for i, line in enumerate(lines) if line or lines[i - 1]).rstrip() + "\n"  # one blank at most


def summary_lines(result: dict) -> list[str]:
    """A few lines that say what ``kvcli analyze`` found, for stdout."""
    att, sim, pos, wav = result["attention"], result["similarity"], result["positions"], result["wavelet"]
    layers = att["layers"]
    third = max(1, layers // 3)
    entropy = att["layer_entropy_bits"]
    keys = att["layer_keys_fraction"]

    def mean(values: Sequence[float]) -> float:
        return sum(values) / len(values)

    rho = att["entropy_vs_depth_spearman"]
    rho = float("nan") if rho is None else rho  # NaN (a single layer) is null in JSON
    trend = "falls with depth (funnels)" if rho < -0.3 else "rises with depth" if rho > 0.3 else "no clear trend"
    lines = [
        f"attention entropy (bits, last {result['queries']} queries, mean over heads): first {third} layers "
        f"{mean(entropy[:third]):.2f}, middle {mean(entropy[third:layers - third] or entropy):.2f}, last {third} "
        f"{mean(entropy[-third:]):.2f}; Spearman vs depth {rho:+.2f}: {trend}",
        f"keys holding {att['mass']:.0%} of attention: first {third} layers {mean(keys[:third]):.1%}, last {third} "
        f"{mean(keys[-third:]):.1%} of the visible keys (min {min(keys):.1%} at layer {keys.index(min(keys))}, "
        f"max {max(keys):.1%} at layer {keys.index(max(keys))})",
        f"PoD groups (1 - JS >= {sim['threshold']}) of {layers} layers: per query head {sim['group_counts']}, "
        f"per KV head (majority vote) {sim['kv_group_counts']}, mean matrix {len(sim['mean_matrix_groups'])}",
    ]
    length = result["tokens"]
    quarter_edges = [round(i * length / 4) for i in range(5)]
    lines.append(f"kept positions at cache {pos['cache']} (share of kept tokens in each quarter of the "
                 f"{length:,}-token prompt):")
    edges = pos["bin_edges"]
    for name, row in pos["methods"].items():
        totals = [0.0] * 4
        for b, count in enumerate(map(sum, zip(*row["counts"], strict=True))):
            centre = (edges[b] + edges[b + 1]) / 2
            totals[min(3, sum(centre >= e for e in quarter_edges[1:4]))] += count
        whole = sum(totals) or 1.0
        lines.append(f"  {name:<14} " + "  ".join(f"{t / whole:6.1%}" for t in totals))
    mags = wav["magnitude"]
    w_edges = wav["bin_edges"]
    inside = [i for i in range(len(w_edges) - 1)
              if w_edges[i] >= wav["start"] + wav["edge"] and w_edges[i + 1] <= length - wav["edge"]]
    if len(inside) >= 4:
        head, tail = inside[: len(inside) // 4], inside[-(len(inside) // 4):]
        ratios = ", ".join(f"{name} {mean([c[i] for i in tail]) / max(mean([c[i] for i in head]), 1e-12):.1f}x"
                           for name, c in mags.items())
        lines.append(f"Haar detail magnitude, last quarter / first quarter (edges of {wav['edge']} excluded): "
                     f"{ratios}")
    return lines


def _count(value: float) -> str:
    """A parameter count the way model names say it: 135M, 8.03B."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.0f}"


def speed_table(result: dict) -> str:
    """``kvcli bench-speed``'s result: what ran and the measured matmul rate MFU is relative to, then one row
    per line (the plain forward, then kvcli per method)."""
    buffer = io.StringIO()
    console = _console(buffer)
    console.print(f"{result['shape']}: {_count(result['parameters'])} parameters, random weights "
                  f"{mib(result['weight_bytes'])} · {result['device_name']} {result['dtype']}, "
                  f"{result['threads']} threads")
    console.print(f"cache {result['cache']:,} · block {result['block']:,} · {result['tokens']:,} tokens timed "
                  f"per line · {result['flops_per_token'] / 1e9:.3g} GFLOP/token")
    console.print(f"measured matmul rate (MFU's peak): {result['matmul_tflops']:.3g} TFLOP/s "
                  f"({result['matmul_size']} square, {result['dtype']})")
    table = Table()
    for name in ("line", "tokens/s", "vs plain", "TFLOP/s", "MFU", "peak memory"):
        table.add_column(name, justify="left" if name == "line" else "right")
    for row in result["rows"]:
        table.add_row(row["line"], f"{row['tokens_per_second']:,.0f}",
                      "-" if row["vs_plain"] is None else f"{row['vs_plain']:.2f}x",
                      f"{row['tflops']:.3g}", f"{row['mfu']:.1%}", mib(row["peak_memory_bytes"]))
    console.print(table)
    return buffer.getvalue()
