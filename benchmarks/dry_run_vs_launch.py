"""The dry run and the planner against real launches on CPU (gloo, one torch thread a rank): the zoo GPT at tp2,
pp2 x tp2, dp2 x tp2 (FSDP2 replicas) and one process, and a tiny transformers Llama at tp2. Each real rank counts
step 2 (`StepBytes`, a callback added to train.py's ranks) two ways: the dry run's own count of live tensors and the
CPU allocator's (the profiler's allocation events); the dry run and the planner run the same configuration.
Writes results/dry_run_vs_launch.{json,md} (`--name` another, e.g. with `--root` another checkout's dry run).
Usage: .venv/bin/python benchmarks/dry_run_vs_launch.py [--rows NAME ...] [--root DIR --dry-only --name NAME]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from harness import HERE, ROOT, THREADS_ENV, machine, one_line, run, with_benchmarks_path, write_results
from torch.profiler import ProfilerActivity, profile
from typing_extensions import override

from lightning_parallel.dryrun.live_bytes import LiveBytes
from lightning_parallel.one_process_ranks import local_part

GPT = ["model=transformer", "model.width=256", "model.depth=4", "model.heads=4", "data=synthetic_tokens",
       "data.vocab_size=2048", "data.seq_len=64", "data.batch_size=8", "trainer.accelerator=cpu"]  # fmt: skip
QUIET = ["trainer.max_steps=2", "trainer.limit_val_batches=0", "callbacks.progress_bar=null", "~logger",
         "callbacks.lr_monitor=null", "callbacks.model_checkpoint=null", "callbacks.step_checkpoint=null",
         "+trainer.enable_checkpointing=false"]  # fmt: skip
TENSOR = ["strategy=tensor", "strategy.tensor_parallel_size={tp}", "strategy.data_parallel_size={dp}",
          "trainer.devices={n}"]  # fmt: skip
PIPELINE = ["strategy=pipeline", "strategy.pipeline_parallel_size=2", "strategy.tensor_parallel_size=2",
            "trainer.devices=4"]  # fmt: skip
ROWS: dict[str, tuple[int, list[str]]] = {  # name -> (tensor-parallel size, overrides); llama: this script's mode
    "GPT one process": (1, [*GPT, *(o.format(tp=1, dp=1, n=1) for o in TENSOR)]),
    "GPT tp2": (2, [*GPT, *(o.format(tp=2, dp=1, n=2) for o in TENSOR)]),
    "GPT dp2 x tp2 (FSDP2)": (2, [*GPT, *(o.format(tp=2, dp=2, n=4) for o in TENSOR)]),
    "GPT pp2 x tp2 (1F1B, 4 micro-batches)": (2, [*GPT, *PIPELINE]),
    "Llama tp2": (2, ["llama"]),
}
KEYS = ("params", "grads", "optimizer")
LLAMA = {"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}  # fmt: skip


class StorageLiveBytes(LiveBytes):
    """`LiveBytes` that also counts a storage made before it started and resized from empty while it runs: FSDP2
    gathers a block into the storage it freed after the step before (`resize_(0)`), which the dry run's one step
    makes new."""

    def __enter__(self) -> StorageLiveBytes:
        super().__enter__()
        counted, tracker = torch.UntypedStorage.resize_, self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            if storage not in tracker._seen and storage.nbytes() == 0:
                tracker._count(torch.empty(0, dtype=torch.uint8).set_(storage))  # tracked from 0 bytes
            return counted(storage, size)

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        return self


class StepBytes(pl.Callback):
    """On every rank, training step `step` (0-based; from the second on the optimizer's state is held throughout, as
    in the dry run's step): local parameter, gradient and optimizer-state bytes, the step's peak of live tensors,
    and the allocator's peak (what was held + the most the step allocated and had not freed at once); written to
    `<out>/step_bytes_rank<r>.json`."""

    def __init__(self, out: str, step: int = 1) -> None:
        self.out, self.step = Path(out), step
        self._live: StorageLiveBytes | None = None
        self._profile: Any = None
        self._held = 0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        state = [v for s in trainer.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v)]
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        self._live = StorageLiveBytes([*module.parameters(), *module.buffers(), *state])
        self._held = self._live.live  # each held storage once
        self._live.__enter__()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if self._live is None:
            return
        self._live.__exit__(None, None, None)
        self._profile.__exit__(None, None, None)
        state = trainer.optimizers[0].state.values()
        record = {
            "rank": trainer.global_rank,
            "params": _bytes(module.parameters()),
            "grads": _bytes(p.grad for p in module.parameters() if p.grad is not None),
            "optimizer": _bytes(v for s in state for v in s.values() if torch.is_tensor(v)),
            "live_peak": self._live.peak,
            "allocator_peak": self._held + _allocated_peak(self._profile),
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"step_bytes_rank{trainer.global_rank}.json").write_text(json.dumps(record))
        self._live = self._profile = None


def _bytes(tensors: Any) -> int:
    return sum(local_part(t).numel() * local_part(t).element_size() for t in tensors)


def _allocated_peak(prof: Any) -> int:
    """The most bytes the CPU allocator had handed out at once while profiling (its running total counts only what
    it allocated since the profile started)."""
    from torch._C._profiler import _EventType

    peak, stack = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            peak = max(peak, node.extra_fields.total_allocated)
        stack.extend(node.children)
    return int(peak)


# ---- the tiny Llama, launched by Lightning (its ranks re-run this script's command line) --------------------------
def llama_module(device: str) -> Any:
    from causal_lm import CausalLM
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return CausalLM(LlamaForCausalLM(LlamaConfig(**LLAMA)))


def llama_batches() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, LLAMA["vocab_size"], (4, 8, 64), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


def llama(mode: str, out: str) -> None:
    """`--llama launch OUT`: train 2 steps at tp2 with `StepBytes`; `--llama dry OUT`: its dry run's dry_run.json."""
    import lightning_parallel as lp

    strategy = lp.TensorParallelStrategy(tensor_parallel_size=2, data_parallel_size=1)
    if mode == "dry":
        lp.dry_run(llama_module("meta"), strategy, devices=2, batch=llama_batches()[0], output_dir=out)
        return
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, callbacks=[StepBytes(out)])  # fmt: skip
    trainer.fit(llama_module("meta"), train_dataloaders=torch.utils.data.DataLoader(llama_batches(), batch_size=None))


# ---- the rows ------------------------------------------------------------------------------------------------------
def launched(overrides: list[str], timeout: float) -> list[dict[str, Any]] | str:
    """Each rank's `StepBytes` record of a real launch, or the line why it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        if overrides == ["llama"]:
            command = [sys.executable, __file__, "--llama", "launch", tmp]
        else:
            command = [sys.executable, str(ROOT / "train.py"), *overrides, *QUIET, f"hydra.run.dir={tmp}/run",
                       f"+callbacks.step_bytes={{_target_: dry_run_vs_launch.StepBytes, out: '{tmp}'}}"]  # fmt: skip
        code, output = run(command, timeout=timeout, env=with_benchmarks_path(THREADS_ENV), cwd=Path(tmp))
        ranks = sorted(Path(tmp).glob("step_bytes_rank*.json"), key=lambda p: int(p.stem[15:]))
        return [json.loads(p.read_text()) for p in ranks] if code == 0 and ranks else one_line(output, code)


def dry(overrides: list[str], root: Path, timeout: float) -> dict[str, Any] | str:
    """The dry run's dry_run.json for the same configuration (train.py's, or this script's Llama mode), run with
    `root`'s code."""
    with tempfile.TemporaryDirectory() as tmp:
        if overrides == ["llama"]:
            command = [sys.executable, __file__, "--llama", "dry", tmp]
        else:
            command = [sys.executable, str(root / "train.py"), *overrides, "dry_run=true", f"hydra.run.dir={tmp}"]
        env = {**THREADS_ENV, "PYTHONPATH": f"{HERE}:{root}"}  # root's lightning_parallel, this script's helpers
        code, output = run(command, timeout=timeout, env=env, cwd=Path(tmp))
        report = Path(tmp) / "dry_run.json"
        return json.loads(report.read_text()) if code == 0 and report.exists() else one_line(output, code)


def table(rows: list[dict[str, Any]], wall_s: float, dry_only: bool) -> str:
    mib = 2**20
    lines = [
        "# The dry run and the planner against real launches",
        "",
        "`benchmarks/dry_run_vs_launch.py`: per real rank of a CPU launch (gloo), step 2 counted by the dry run's "
        "live-tensor count (**live**) and by torch's CPU allocator (**alloc**: the profiler's allocation events); "
        "**dry** the dry run's step peak for that rank's role, **planner** the planner's; misses against the "
        f"allocator. GPT: `{' '.join(GPT[:-1])}`, AdamW, fp32; Llama: `{LLAMA}`, 8 x 64 tokens. {machine()}, a "
        f"shared machine; {wall_s:.0f} s in all.",
        "",
        "| layout | rank | role | params / grads / optimizer MiB (real; dry; planner) | live | alloc | dry | planner "
        "| dry miss | planner miss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        failed = next((row[key] for key in ("real", "dry") if isinstance(row.get(key), str)), None)
        if failed is not None:
            lines.append(f"| {row['name']} | | | failed: {failed} |||||||")
            continue
        roles, tp = row["dry"]["rows"], row["tp"]
        for real in row.get("real") or [{"rank": r["global_rank"]} for r in roles]:
            role = roles[min(real["rank"] // tp, len(roles) - 1)] if len(roles) > 1 else roles[0]
            m, p = role["measured"], role["predicted"] or {}
            states = " / ".join(f"{real.get(k, 0) / mib:.2f}; {m[k] / mib:.2f}; {p.get(k, 0) / mib:.2f}" for k in KEYS)
            alloc = real.get("allocator_peak")
            miss = [f"{x / alloc - 1:+.1%}" if alloc else "-" for x in (m["total"], p.get("total", 0))]
            live = f"{real['live_peak'] / mib:.2f}" if "live_peak" in real else "-"
            lines.append(f"| {row['name']} | {real['rank']} | {role['role']} | {states} | {live} | "
                         f"{alloc / mib if alloc else 0:.2f} | {m['total'] / mib:.2f} | {p.get('total', 0) / mib:.2f} "
                         f"| {miss[0]} | {miss[1]} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", nargs="*", help="only these rows (names as in ROWS)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose dry run and planner run")
    parser.add_argument("--dry-only", action="store_true", help="no launches: the dry run and planner alone")
    parser.add_argument("--name", default="dry_run_vs_launch", help="results/<name>.{json,md}")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--llama", nargs=2, metavar="MODE OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llama:
        return llama(*args.llama)
    started, rows = time.perf_counter(), []
    for name, (tp, overrides) in ROWS.items():
        if args.rows and name not in args.rows:
            continue
        row: dict[str, Any] = {"name": name, "tp": tp, "overrides": overrides}
        row["dry"] = dry(overrides, args.root.resolve(), args.timeout)
        if not args.dry_only:
            row["real"] = launched(overrides, args.timeout)
        print(name, "done", flush=True)
        rows.append(row)
    wall_s = time.perf_counter() - started
    report = {"machine": machine(), "root": str(args.root), "rows": rows, "wall_s": wall_s}
    write_results(args.name, report, table(rows, wall_s, args.dry_only), wall_s, indent=2)


if __name__ == "__main__":
    main()
