"""How the dry run counts bytes (`dryrun/live_bytes.py`, `dryrun/step.py`): what is held counted once, storages
freed and resized, the optimizer's state through the step, a collective's wait on fake tensors as on real ones."""

from __future__ import annotations

import torch


def test_live_bytes_counts_what_is_held_once_and_follows_a_resized_storage() -> None:
    """An in-place update of a held parameter adds nothing (it was counted once, as held); a storage freed by
    `resize_(0)` (as FSDP2 frees a gathered block) leaves the count, and comes back when resized again."""
    from lightning_parallel.dryrun.live_bytes import LiveBytes

    weight = torch.zeros(256, 256)
    with LiveBytes([weight]) as live:
        weight.mul_(0.5)
        gathered = torch.zeros(1024)
        assert live.live == weight.nbytes + gathered.nbytes
        gathered.untyped_storage().resize_(0)
        assert live.live == weight.nbytes
        gathered.untyped_storage().resize_(4096)
        assert live.live == weight.nbytes + 4096
    assert live.peak == weight.nbytes + gathered.nbytes


def test_the_optimizer_state_counts_through_forward_and_backward() -> None:
    """The step's peak holds the optimizer's state beside the activations: with activations (16 x the parameters)
    freed before the update, AdamW's step peaks its 2 states higher than plain SGD's, as a device holds them; it
    read the same when the state was counted only once the update touched it."""
    import lightning.pytorch as pl

    from lightning_parallel.dryrun.step import tracked_step

    class Wide(pl.LightningModule):
        def __init__(self, optimizer: type[torch.optim.Optimizer]) -> None:
            super().__init__()
            self.layer, self.optimizer = torch.nn.Linear(64, 64, bias=False), optimizer

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return self.optimizer(self.parameters(), lr=0.1)

    peaks = {}
    for optimizer in (torch.optim.AdamW, torch.optim.SGD):
        module = Wide(optimizer)

        def run(module: Wide = module) -> None:
            x = torch.ones(1024, 64, requires_grad=True)  # 16 x the weight's bytes
            (module.layer(x) * 2).sum().backward()

        peaks[optimizer] = tracked_step(module, run)["peak_total"]
    weight = 64 * 64 * 4
    assert peaks[torch.optim.AdamW] - peaks[torch.optim.SGD] >= 2 * weight, peaks


def test_a_collectives_wait_holds_no_second_copy_of_its_output() -> None:
    """A functional all-gather waited on (what DTensor's redistribute runs): the dry run's count on fake tensors is the
    count on real ones, where the wait returns the very tensor it waited on (a fake wait gives new storage, which
    counted the gathered bytes twice while both lived)."""
    from lightning_parallel.dryrun.live_bytes import LiveBytes
    from lightning_parallel.one_process_ranks import fake_rank, fake_tensors

    def peak() -> int:
        group = torch.distributed.group.WORLD.group_name
        shard = torch.zeros(256, 64)
        with LiveBytes([shard]) as live:
            gathered = torch.ops._c10d_functional.all_gather_into_tensor(shard, 2, group)
            waited = torch.ops._c10d_functional.wait_tensor(gathered)
            del gathered
            total = waited.sum()  # noqa: F841 - alive beside the waited output
        return live.peak

    with fake_rank(0, 2):
        real = peak()
        with fake_tensors():
            fake = peak()
    assert real == fake == (256 + 512) * 64 * 4 + 4, (real, fake)
