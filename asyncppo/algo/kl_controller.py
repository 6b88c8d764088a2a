"""KL coefficient controllers for KL-in-reward.

The adaptive controller (Ziegler et al., 2019) nudges the coefficient so the measured KL tracks a
target: the proportional error is clipped to +-20 % so one noisy batch cannot swing the coefficient,
and ``horizon`` (in samples) sets how fast it moves.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["FixedKLController", "AdaptiveKLController", "KL_CONTROLLERS", "get_kl_controller", "kl_controller_from_config"]


class FixedKLController:
    """A constant coefficient; ``update`` is a no-op (kept so callers need not branch)."""

    def __init__(self, init_kl_coef: float):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        self.value = float(init_kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        return None

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0 for the adaptive KL controller, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"kl_horizon must be > 0 for the adaptive KL controller, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """``n_steps``: samples (sequences) the ``current_kl`` measurement was taken over."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


KL_CONTROLLERS = {"fixed": FixedKLController, "adaptive": AdaptiveKLController}


def get_kl_controller(
    type: str, init_kl_coef: float, target_kl: Optional[float] = None, horizon: Optional[int] = None
):
    """Build a controller by name (``fixed`` | ``adaptive``)."""
    if type == "fixed":
        return FixedKLController(init_kl_coef)
    if type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("the adaptive KL controller needs target_kl and horizon (kl_horizon)")
        return AdaptiveKLController(init_kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl_ctrl.type {type!r}; allowed: {', '.join(KL_CONTROLLERS)}")


def kl_controller_from_config(kl_ctrl) -> object:
    """Build from an object with ``type``, ``init_kl_coef``, ``target_kl``, ``kl_horizon`` attributes."""
    return get_kl_controller(kl_ctrl.type, kl_ctrl.init_kl_coef, kl_ctrl.target_kl, kl_ctrl.kl_horizon)
