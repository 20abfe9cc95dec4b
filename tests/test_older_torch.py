"""What differs on torch 2.11 / 2.12 and how each seam absorbs it, checked on whichever torch runs the suite (the
older torch's behaviour imitated where it matters): gradients for detached stage inputs, a spent checkpoint stager."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_parallel import autograd_seams, seams


class _Stage211Grads:  # torch 2.11 / 2.12's stage: a gradient goes back for every received input
    is_first = False

    def __init__(self, grads: tuple, cos_requires_grad: bool = True) -> None:  # 2.11: every buffer requires grad
        hidden = torch.zeros(2, 3, requires_grad=True)
        cos = torch.zeros(2, 3, requires_grad=cos_requires_grad)  # 2.12: as stage 0's output had (RoPE's cos: none)
        self.args_recv_info = {0: (SimpleNamespace(buffer=hidden, source=0), SimpleNamespace(buffer=cos, source=0))}
        self.bwd_cache = {0: grads}
        self.grad_send_info: list | None = None

    def get_bwd_send_ops(self, chunk: int) -> list:
        if self.grad_send_info is None:
            self.grad_send_info = [info.source for info in self.args_recv_info[0]]
        sent = []
        for grad, destination in zip(self.bwd_cache.pop(chunk), self.grad_send_info, strict=True):
            if grad is None and destination is not None:
                raise RuntimeError("has gradients None and is expecting to send gradients to stage 0")
            sent += [grad] if destination is not None else []
        return sent

    def backward_maybe_with_nosync(self, kind: str, kwargs: dict, last_backward: bool = False) -> tuple:
        raise AssertionError("the seam runs a backward only for a split backward's input pass (_Stage211Split)")


@pytest.mark.parametrize("installed", ["2.11.0+cu130", "2.12.1+cu130", "2.13.0+cpu"])
def test_a_detached_stage_input_sends_zeros_back_on_torch_before_2_13(monkeypatch, installed: str) -> None:
    """2.11's receive buffers all require grad, and the previous stage waits for each gradient: zeros go back for
    RoPE's cos. 2.12's cos buffer requires none (as stage 0's output), and none is received: nothing goes back."""
    monkeypatch.setattr(torch, "__version__", installed)
    stage = _Stage211Grads((torch.ones(2, 3), None), cos_requires_grad=not installed.startswith("2.12"))
    autograd_seams.send_zero_gradients(stage)
    if installed.startswith("2.11"):
        sent = stage.get_bwd_send_ops(0)
        assert [float(g.sum()) for g in sent] == [6.0, 0.0] and sent[1].shape == (2, 3)
    elif installed.startswith("2.12"):
        assert [float(g.sum()) for g in stage.get_bwd_send_ops(0)] == [6.0]
    else:  # 2.13 expects no gradient for it: the stage is left as torch made it
        with pytest.raises(RuntimeError, match="has gradients None"):
            stage.get_bwd_send_ops(0)


def test_a_background_write_stages_every_save_whether_torch_spends_its_stager_or_not() -> None:
    """torch 2.11's DefaultStager clears its copy table after one stage (a second failed with KeyError <class 'type'>);
    BackgroundWrite then takes a fresh one. Staged three times here, each stager spent as 2.11 spends it."""
    from lightning_parallel.background_write import BackgroundWrite

    writes = BackgroundWrite()
    try:
        for step in range(3):
            staged = writes.stage({"step": step, "model": {"w": torch.full((3,), float(step))}})
            assert staged["step"] == step and torch.equal(staged["model"]["w"], torch.full((3,), float(step)))
            writes.stager._state_dict_stager.close()  # what torch 2.11 does at the end of each stage
    finally:
        writes.close()
    spent = SimpleNamespace(_state_dict_stager=SimpleNamespace(_deepcopy_dispatch={}))
    assert seams.stager_spent(spent) and not seams.stager_spent(
        SimpleNamespace(_state_dict_stager=SimpleNamespace(_deepcopy_dispatch={int: None}))
    )
    with pytest.raises(seams.SeamChanged, match="DefaultStager"):
        seams.stager_spent(SimpleNamespace())


class _Stage211Split(_Stage211Grads):  # and its split backward's input pass (stage_backward_input)
    def backward_maybe_with_nosync(self, kind: str, kwargs: dict, last_backward: bool = False) -> tuple:
        """Differentiates every output and every input requiring a gradient, one detached inside the stage too."""
        values = [v for v in kwargs["input_values"] if v.requires_grad]
        grads = kwargs["output_grads"] or [torch.ones_like(t) for t in kwargs["stage_output"]]
        return torch.autograd.grad(kwargs["stage_output"], values, grad_outputs=grads, retain_graph=True), []


class _DetachingStage(torch.nn.Module):  # as a traced stage takes RoPE's cos (stage_gradients) and hands it on
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = cos.detach()
        return cos, self.linear(hidden) * cos


def test_a_split_backward_input_pass_differentiates_only_what_a_stage_with_detached_inputs_uses(monkeypatch) -> None:
    """Zero-bubble schedules and DualPipeV on torch 2.11 / 2.12: a stage takes cos detached though its receive buffer
    requires grad, and hands it on without one; torch's input pass failed on both, the seam's gives the hidden states
    the full backward's gradient and cos none (sent back as zeros). Measured on 2.11: a traced Llama pp2 under
    interleaved_zero_bubble, zbv and dualpipev failed its first backward without it, and matches one process with it."""
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    torch.manual_seed(0)
    fed = [torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)]  # 2.11's receive buffers
    out = _DetachingStage()(*fed)
    grad = torch.randn(2, 4)
    handed_on = {"stage_output": out, "output_grads": [torch.zeros(2, 4), grad], "input_values": fed}
    used_only = {"stage_output": out[1:], "output_grads": [grad], "input_values": fed}
    stage = _Stage211Split((None,))
    for kwargs, error in ((handed_on, "does not require grad"), (used_only, "not have been used in the graph")):
        with pytest.raises(RuntimeError, match=error):
            stage.backward_maybe_with_nosync("input", kwargs)
    autograd_seams.send_zero_gradients(stage)
    (want,) = torch.autograd.grad(out[1], fed[0], grad, retain_graph=True)
    for kwargs in (handed_on, used_only):
        given, _ = stage.backward_maybe_with_nosync("input", kwargs)
        assert len(given) == 2 and given[1] is None
        torch.testing.assert_close(given[0], want, rtol=0, atol=0)
