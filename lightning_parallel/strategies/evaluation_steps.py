"""Lightning's validation, test and predict steps, each run through one method of the strategy (`_evaluating`): the
tensor strategy's logits session, the pipeline's session and forward-only schedule. The steps themselves are the
user's, unchanged; nothing here knows what a strategy puts around them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from typing_extensions import override

from lightning_parallel.strategies.base import MeshStrategy


class EvaluationThrough(MeshStrategy):
    """Mixin, listed before the strategy it modifies: every evaluation step through `_evaluating`. A `MeshStrategy`
    itself, so that its `super()` calls resolve to Lightning's steps, as they do at run time."""

    def _evaluating(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Lightning's own `step` (which calls the user's) with what the strategy puts around it; here nothing."""
        return step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluating(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluating(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluating(super().predict_step, *args, **kwargs)
