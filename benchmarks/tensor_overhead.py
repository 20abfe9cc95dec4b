"""Step time of TensorParallelStrategy inside a Lightning Trainer against a hand-written DTensor loop (torch's
`parallelize_module` with the same Megatron split as GPT's `tp_plan`; same weights, batches and optimizer), the
single-process step for scale, parameter bytes and peak RSS per rank. Writes results/tensor_overhead.{json,md}.

Launches its ranks with torchrun (harness.py), one thread each; it does not use tests/.
Usage: .venv/bin/python benchmarks/tensor_overhead.py [--steps 8 --warmup 2 --repeats 10]
Over 300 lines: one measurement, its worker mode and its report in one script, so a result file traces to one
command.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import Usage, arguments, counts, launch, machine, order, other_cores, stats_ms, worker_setup, write_results
from ranks import bare_trainer, batch_loader
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from lightning_parallel import TensorParallelStrategy
from lightning_parallel.models import GPT
from lightning_parallel.tasks.language_model import LanguageModelTask

WIDTH, DEPTH, HEADS, VOCAB, CONTEXT, BATCH, TP, LR, DISTINCT_BATCHES = 256, 4, 8, 256, 64, 8, 2, 1e-3, 4
# kind -> what its table row says; "single" (rank 0 alone, plain loop) runs first in every repeat
KINDS = {
    "handwritten": "hand-written: parallelize_module + forward, cross-entropy, backward, step, zero_grad",
    "strategy": "TensorParallelStrategy, minimal LightningModule (no logging)",
    "strategy_lm_task": "TensorParallelStrategy, the library's LanguageModelTask (logs train/loss, sync_dist)",
}
TARGET = 0.05  # the strategy may cost at most 5% more per step than the hand-written loop
QUIET = 0.1  # a run is quiet when other processes used less than this many cores during it


# ---- the workload, identical in every run -------------------------------------------------------
def build_network(state: dict[str, torch.Tensor] | None = None) -> GPT:
    network = GPT(vocab_size=VOCAB, context_length=CONTEXT, depth=DEPTH, width=WIDTH, heads=HEADS)
    if state is not None:
        network.load_state_dict(state)
    return network


def megatron_plan() -> dict[str, ParallelStyle]:
    """GPT.tp_plan (without sequence parallelism) written directly in torch's styles."""
    plan: dict[str, ParallelStyle] = {"embed.token": RowwiseParallel(input_layouts=Replicate())}  # vocab-parallel
    for i in range(DEPTH):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.up"):
            plan[f"block_{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.down"):
            plan[f"block_{i}.{name}"] = RowwiseParallel()
    plan["head.lm_head"] = ColwiseParallel(output_layouts=Replicate())  # gathered logits
    return plan


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=generator) for _ in range(DISTINCT_BATCHES)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())  # (B, T, V) against (B, T)


def parameter_bytes(module: nn.Module) -> int:
    local = (p.to_local() if isinstance(p, DTensor) else p for p in module.parameters())
    return sum(t.numel() * t.element_size() for t in local)


class MinimalTask(pl.LightningModule):
    """The network at `model`, cross-entropy, SGD: what the hand-written loop does, nothing more."""

    def __init__(self, network: GPT) -> None:
        super().__init__()
        self.model = network

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return lm_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


# ---- timed runs (inside each rank) ---------------------------------------------------------------
def rss_kib(field: str) -> int | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def reset_peak_rss() -> int | None:
    """Free what earlier runs left, reset this process's peak RSS (VmHWM) to its current RSS; return that."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return rss_kib("VmRSS")


class Probe:
    """Per step on this rank: wall and own-CPU time at the window's ends, wall time around the network's forward
    and around backward, the loss. perf_counter is CLOCK_MONOTONIC on Linux, so all ranks share one clock and the
    slowest rank of each step is found afterwards (critical_path)."""

    WINDOWS = ("forward_start", "forward_end", "backward_start", "backward_end")

    def __init__(self) -> None:
        self.usage = Usage()
        self.reset()

    def reset(self) -> None:
        names = ("start", "end", "cpu_start", "cpu_end", "loss", *self.WINDOWS)
        self.marks: dict[str, list[float]] = {name: [] for name in names}
        self._rss = reset_peak_rss()
        self.usage.start()

    def mark(self, name: str) -> None:
        self.marks[name].append(time.perf_counter())
        if name in ("start", "end"):
            self.marks[f"cpu_{name}"].append(time.process_time())

    def watch(self, network: nn.Module) -> nn.Module:
        """Time the network's forward (root hooks, the same in every run); backward is timed by time_backward."""
        network.register_forward_pre_hook(lambda *_: self.mark("forward_start"))
        network.register_forward_hook(lambda *_: self.mark("forward_end"))
        return network

    def result(self, module: nn.Module) -> dict[str, Any]:
        """The marks, wall / own CPU / machine-wide busy CPU seconds of the run (others' load shows), memory."""
        return {
            **self.marks,
            **self.usage.totals(),
            "parameter_bytes": parameter_bytes(module),
            "rss_start_kib": self._rss,
            "peak_rss_kib": rss_kib("VmHWM") if self._rss is not None else None,
        }


PROBE = Probe()


def time_backward() -> None:
    """Wrap torch.autograd.backward, which Tensor.backward looks up at each call (Lightning's path included)."""
    inner = torch.autograd.backward

    def timed(*args: Any, **kwargs: Any) -> Any:
        PROBE.mark("backward_start")
        try:
            return inner(*args, **kwargs)
        finally:
            PROBE.mark("backward_end")

    torch.autograd.backward = timed  # type: ignore[assignment]


class StepTimer(pl.Callback):
    """Barrier, then on_train_batch_start to on_train_batch_end: the window the hand-written loop times."""

    def on_train_batch_start(self, *args: Any) -> None:
        dist.barrier()
        PROBE.mark("start")

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        PROBE.mark("end")
        PROBE.marks["loss"].append(float(outputs["loss"]))


def run_handwritten(state: dict, batches: list, total: int, mesh: DeviceMesh) -> dict[str, Any]:
    network = PROBE.watch(build_network(state))
    parallelize_module(network, mesh, megatron_plan(), src_data_rank=None)  # same weights on every rank already
    optimizer = torch.optim.SGD(network.parameters(), lr=LR)
    PROBE.reset()
    for i in range(total):
        x, y = batches[i % len(batches)]
        dist.barrier()
        PROBE.mark("start")
        loss = lm_loss(network(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        PROBE.mark("end")
        PROBE.marks["loss"].append(loss.item())
    return PROBE.result(network)


def run_strategy(kind: str, state: dict, batches: list, total: int) -> dict[str, Any]:
    strategy = TensorParallelStrategy(tensor_parallel_size=TP, timeout=300)
    trainer = bare_trainer(strategy, TP, total, [StepTimer()])
    network = PROBE.watch(build_network(state))
    if kind == "strategy":
        task: pl.LightningModule = MinimalTask(network)
    else:
        task = LanguageModelTask(network, optimizer=functools.partial(torch.optim.SGD, lr=LR))
    loader = batch_loader(batches, total)
    PROBE.reset()
    trainer.fit(task, train_dataloaders=loader)
    described = strategy.describe()
    return {**PROBE.result(network), "described_bytes_per_rank": described["parameter_bytes_per_rank"],
            "sharded_modules": len(described["sharded"])}  # fmt: skip


def run_single(state: dict, batches: list, total: int) -> dict[str, Any]:
    """One process, whole model, plain loop: forward, loss, backward, optimizer.step, zero_grad."""
    network = PROBE.watch(build_network(state))
    optimizer = torch.optim.SGD(network.parameters(), lr=LR)
    PROBE.reset()
    for i in range(total):
        x, y = batches[i % len(batches)]
        PROBE.mark("start")
        loss = lm_loss(network(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        PROBE.mark("end")
        PROBE.marks["loss"].append(loss.item())
    return PROBE.result(network)


def worker(out: Path, args: argparse.Namespace) -> None:
    rank, total = worker_setup(), args.warmup + args.steps  # the strategy reuses its process group
    time_backward()
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    state, batches, runs = build_network().state_dict(), make_batches(), []
    for rep in range(args.repeats):
        if rank == 0:  # rank 1 waits in the barrier below (a blocking socket wait, no CPU)
            runs.append({"kind": "single", "repeat": rep, **run_single(state, batches, total)})
        dist.barrier()
        # forward order on even repeats, reversed on odd ones: linear drift cancels in pairs of repeats
        for kind in order(rep, list(KINDS)):
            if kind == "handwritten":
                result = run_handwritten(state, batches, total, mesh)
            else:
                result = run_strategy(kind, state, batches, total)
            runs.append({"kind": kind, "repeat": rep, **result})
            dist.barrier()
        print(f"rank {rank}: repeat {rep + 1}/{args.repeats} done", flush=True)
    (out / f"rank{rank}.json").write_text(json.dumps(runs))
    dist.destroy_process_group()


# ---- report (main process) ----------------------------------------------------------------------
def critical_path(runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Per measured step across the ranks of one run (steps start together at a barrier). step: the slowest
    rank's window; cpu: own CPU seconds in the window, mean over ranks (waiting for CPU does not count);
    outside: the window less the network's forward and backward, mean over ranks; period: barrier to next
    barrier. other_load_cores: other processes' CPU use during the run."""
    out: dict[str, Any] = {"step_s": [], "cpu_s": [], "outside_s": [], "period_s": []}
    n = len(runs[0]["start"])
    if any(len(run[name]) != n for run in runs for name in Probe.WINDOWS):
        raise RuntimeError("expected exactly one forward and one backward per step")
    for i in range(warmup, n):
        out["step_s"].append(max(run["end"][i] - run["start"][i] for run in runs))
        out["cpu_s"].append(statistics.mean(run["cpu_end"][i] - run["cpu_start"][i] for run in runs))
        out["outside_s"].append(
            statistics.mean(
                (run["end"][i] - run["start"][i])
                - (run["forward_end"][i] - run["forward_start"][i])
                - (run["backward_end"][i] - run["backward_start"][i])
                for run in runs
            )
        )
        if i + 1 < n:
            out["period_s"].append(max(run["start"][i + 1] - run["start"][i] for run in runs))
    out["other_load_cores"] = other_cores(runs)
    out["loss"] = runs[0]["loss"]
    return out


def merge_ranks(per_rank: list[list[dict[str, Any]]], warmup: int) -> list[dict[str, Any]]:
    """One entry per run: its critical-path series and every rank's raw numbers."""
    by_key = [{(run["kind"], run["repeat"]): run for run in rank_runs} for rank_runs in per_rank]
    merged = []
    for first in per_rank[0]:
        key = (first["kind"], first["repeat"])
        runs = [ranks[key] for ranks in by_key if key in ranks]  # single: rank 0 only
        merged.append({"kind": key[0], "repeat": key[1], **critical_path(runs, warmup), "per_rank": runs})
    return merged


def pooled(runs: list[dict[str, Any]], series: str) -> dict[str, float]:
    return stats_ms([t for run in runs for t in run[series]])


def memory(runs: list[dict[str, Any]]) -> dict[str, list[float] | None]:
    """Per rank, medians over the runs of one kind (MiB): peak RSS, and how far it rose above the run's start."""
    ranks = range(len(runs[0]["per_rank"]))
    peaks = [[r["per_rank"][k]["peak_rss_kib"] for r in runs] for k in ranks]
    starts = [[r["per_rank"][k]["rss_start_kib"] for r in runs] for k in ranks]
    if any(None in p for p in peaks):
        return {"peak": None, "added": None}
    added = [[p - s for p, s in zip(pk, st, strict=True)] for pk, st in zip(peaks, starts, strict=True)]
    return {"peak": [statistics.median(p) / 1024 for p in peaks], "added": [statistics.median(a) / 1024 for a in added]}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    of = {kind: [r for r in runs if r["kind"] == kind] for kind in ("single", *KINDS)}
    load = [r["other_load_cores"] for r in runs]
    first_losses = {kind: of[kind][0]["loss"] for kind in of}  # same weights and batches: same trajectory
    summary: dict[str, Any] = {
        "single_step_ms": pooled(of["single"], "step_s"),
        "single_cpu_ms": pooled(of["single"], "cpu_s"),
        "single_parameter_bytes": of["single"][0]["per_rank"][0]["parameter_bytes"],
        "single_peak_rss_mib": memory(of["single"]),
        "other_load_cores": {"mean": statistics.mean(load), "max": max(load)},
        "max_loss_difference_vs_handwritten": {
            kind: max(abs(a - b) for a, b in zip(first_losses[kind], first_losses["handwritten"], strict=True))
            for kind in of
        },
    }
    hand = of["handwritten"]
    summary["handwritten"] = {
        "step_ms": pooled(hand, "step_s"),
        "cpu_ms": pooled(hand, "cpu_s"),
        "outside_ms": pooled(hand, "outside_s"),
        "period_ms": pooled(hand, "period_s"),
        "parameter_bytes_per_rank": [r["parameter_bytes"] for r in hand[0]["per_rank"]],
        "peak_rss_mib": memory(hand),
    }
    for kind in ("strategy", "strategy_lm_task"):
        strat = of[kind]
        series = ("step_ms", "cpu_ms", "outside_ms", "period_ms")
        row: dict[str, Any] = {name: pooled(strat, f"{name[:-3]}_s") for name in series}
        hand_step = summary["handwritten"]["step_ms"]
        row["overhead"] = row["step_ms"]["median"] / hand_step["median"] - 1
        row["p10_overhead"] = row["step_ms"]["p10"] / hand_step["p10"] - 1
        row["added_outside_ms"] = row["outside_ms"]["median"] - summary["handwritten"]["outside_ms"]["median"]
        row["added_outside_of_p10_step"] = row["added_outside_ms"] / hand_step["p10"]
        row["cpu_overhead"] = row["cpu_ms"]["median"] / summary["handwritten"]["cpu_ms"]["median"] - 1
        row["overhead_per_repeat"] = [
            statistics.median(s["step_s"]) / statistics.median(h["step_s"]) - 1
            for h, s in zip(hand, strat, strict=True)
        ]
        quiet_hand, quiet_strat = ([r for r in runs_ if r["other_load_cores"] < QUIET] for runs_ in (hand, strat))
        row["quiet_runs"] = [len(quiet_hand), len(quiet_strat)]
        row["quiet_overhead"] = None
        if quiet_hand and quiet_strat:
            row["quiet_overhead"] = pooled(quiet_strat, "step_s")["median"] / pooled(quiet_hand, "step_s")["median"] - 1
        # judged on quiet runs when there are some of each kind: others' load is not the strategy's cost
        judged = row["overhead"] if row["quiet_overhead"] is None else row["quiet_overhead"]
        row["meets_target"] = judged <= TARGET
        row["outside_meets_target"] = row["added_outside_of_p10_step"] <= TARGET
        row["parameter_bytes_per_rank"] = [r["parameter_bytes"] for r in strat[0]["per_rank"]]
        if row["parameter_bytes_per_rank"] != summary["handwritten"]["parameter_bytes_per_rank"]:
            raise RuntimeError(f"{kind} and the hand-written loop shard differently: {row['parameter_bytes_per_rank']}")
        row["described_bytes_per_rank"] = strat[0]["per_rank"][0]["described_bytes_per_rank"]
        row["sharded_modules"] = strat[0]["per_rank"][0]["sharded_modules"]
        row["peak_rss_mib"] = memory(strat)
        summary[kind] = row
    return summary


def markdown(summary: dict[str, Any], config: dict[str, Any]) -> str:
    full, load, hand = summary["single_parameter_bytes"], summary["other_load_cores"], summary["handwritten"]
    fmt = lambda s: f"{s['median']:.1f} ({s['p10']:.1f}-{s['p90']:.1f})"  # noqa: E731

    def mib(m: dict[str, list[float] | None]) -> str:
        if m["peak"] is None or m["added"] is None:
            return "-"
        return f"{' / '.join(f'{v:.0f}' for v in m['peak'])} (+{' / +'.join(f'{v:.0f}' for v in m['added'])})"

    loss = summary["max_loss_difference_vs_handwritten"]
    lines = [
        "# TensorParallelStrategy overhead",
        "",
        f"`benchmarks/tensor_overhead.py`, {config['date']}, {config['machine']}. GPT (width {WIDTH}, {DEPTH} "
        f"blocks, {HEADS} heads, vocabulary {VOCAB}, context {CONTEXT}), batch {BATCH}, cross-entropy, SGD, TP={TP} "
        f"with GPT's Megatron plan (vocab-parallel embedding, q/k/v/up column, proj/down row, gathered logits; no "
        f"sequence parallelism), one thread per process, gloo; {config['repeats']} interleaved repeats (order "
        f"reversed every other repeat) x {config['steps']} steps after {config['warmup']} warm-up steps. Other "
        f"processes used {load['mean']:.2f} cores on average during the runs (max {load['max']:.2f}); on 2 cores "
        f"anything above ~{QUIET} inflates and scatters every number.",
        "",
        "- **step** (median (p10-p90), ms): barrier, then on_train_batch_start to on_train_batch_end (strategy) or "
        "forward + cross-entropy + backward + optimizer.step + zero_grad (hand-written); the slowest rank.",
        "- **overhead**: strategy / hand-written - 1 on the step medians (range: per repeat), and on the p10s (the "
        "least disturbed steps).",
        "- **added outside forward/backward**: per step and rank, the window less the network's forward (root "
        "module hooks) and backward (torch.autograd.backward), mean of the ranks; strategy minus hand-written "
        "medians, and that as a share of the hand-written p10 step. What Lightning and the strategy add around the "
        "model (hooks, closure, loss, optimizer.step, zero_grad), mostly free of others' load; this is the number "
        "to trust when the machine is busy.",
        "- **CPU ms**: this process's own CPU time inside the same window, mean of the ranks: what the step costs "
        "in work, without the time spent waiting for a core that another process holds.",
        f"- **quiet runs**: runs during which other processes used < {QUIET} core; the target is judged on them "
        "when there are some of each kind, else on all runs.",
        "- **iteration**: barrier to next barrier; adds data fetch and Lightning's work between steps.",
        "- **peak RSS**: each rank's VmHWM, reset (after gc and malloc_trim) as each run starts; most of it is the "
        "Python + torch + Lightning process itself, the rise is what the run allocated on top (model, activations, "
        "gradients, Trainer).",
        f"- losses agree step by step (same weights, same batches): max |strategy - hand-written| "
        f"{loss['strategy']:.1e}, LanguageModelTask {loss['strategy_lm_task']:.1e}, single process "
        f"{loss['single']:.1e}. Parameter bytes per rank are the same in the hand-written loop and the strategy.",
        "",
        f"| config | hand-written ms | strategy ms | overhead: median (per-repeat range); p10 | quiet runs: "
        f"overhead (runs) | <= {TARGET:.0%}: step; added outside | added outside forward/backward | CPU ms/step: "
        "hand / strategy | iteration ms: hand / strategy | params/rank (bytes) | vs single | peak RSS/rank MiB "
        "(+ rise in the run): strategy; hand-written |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in ("strategy", "strategy_lm_task"):
        row = summary[kind]
        spread = f"{min(row['overhead_per_repeat']):+.1%} .. {max(row['overhead_per_repeat']):+.1%}"
        quiet = "-" if row["quiet_overhead"] is None else f"{row['quiet_overhead']:+.1%}"
        quiet += f" ({row['quiet_runs'][0]} + {row['quiet_runs'][1]})"
        cpu = (hand["cpu_ms"]["median"], row["cpu_ms"]["median"])
        period = (hand["period_ms"]["median"], row["period_ms"]["median"])
        per_rank = row["parameter_bytes_per_rank"]
        verdict = " / ".join("yes" if ok else "NO" for ok in (row["meets_target"], row["outside_meets_target"]))
        added = f"{row['added_outside_ms']:+.2f} ms ({row['added_outside_of_p10_step']:+.1%})"
        lines.append(
            f"| {KINDS[kind]} | {fmt(hand['step_ms'])} | {fmt(row['step_ms'])} | {row['overhead']:+.1%} ({spread}); "
            f"{row['p10_overhead']:+.1%} | {quiet} | {verdict} | {added} | {cpu[0]:.1f} / {cpu[1]:.1f} "
            f"({row['cpu_overhead']:+.1%}) | {period[0]:.1f} / {period[1]:.1f} ({period[1] / period[0] - 1:+.1%}) | "
            f"{' / '.join(f'{b:,}' for b in per_rank)} | {' / '.join(f'{b / full:.3f}' for b in per_rank)} | "
            f"{mib(row['peak_rss_mib'])}; {mib(hand['peak_rss_mib'])} |"
        )
    lines.append(
        f"| single process, plain loop | {fmt(summary['single_step_ms'])} | | | | | | "
        f"{summary['single_cpu_ms']['median']:.1f} | | {full:,} | 1.000 | {mib(summary['single_peak_rss_mib'])} |"
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    args = arguments(__doc__.splitlines()[0], steps=8, warmup=2, repeats=10, timeout=900)
    if args.worker is not None:
        worker(args.worker, args)
        return
    started = time.perf_counter()
    runs = merge_ranks(launch(__file__, TP, counts(args), timeout=args.timeout), args.warmup)
    config = {
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{machine()}, "
        f"lightning {lightning.__version__}",
        "model": {"name": "GPT", "width": WIDTH, "depth": DEPTH, "heads": HEADS, "vocab_size": VOCAB,
                  "context_length": CONTEXT, "batch": BATCH, "loss": "cross_entropy", "optimizer": "SGD", "lr": LR},
        "tp": TP,
        "kinds": KINDS,
        "target_overhead": TARGET,
        "wall_s": time.perf_counter() - started,
    }  # fmt: skip
    summary = summarise(runs)
    report = {"config": config, "summary": summary, "runs": runs}
    write_results("tensor_overhead", report, markdown(summary, config), config["wall_s"])


if __name__ == "__main__":
    main()
