"""Argument checks of the layout functions: a ModelSpec and a Layout where one is due
(`require_spec`, `require_layout`), and whether a model fits a layout (`check_fits`: tp, pp,
the pipeline partition, experts)."""

from __future__ import annotations

from ..spec import ModelSpec
from .grid import Layout, _short


def require_spec(model, arg: str = "model") -> None:
    """TypeError unless `model` is a ModelSpec (a ModelConfig or a name is a common slip)."""
    if not isinstance(model, ModelSpec):
        hint = (
            " (build one with real_py.model_spec(config))"
            if type(model).__name__ == "ModelConfig" or isinstance(model, str)
            else ""
        )
        raise TypeError(
            f"{arg} must be a real_py.ModelSpec{hint}, got {type(model).__name__} {_short(model)}"
        )


def require_layout(layout, arg: str = "layout") -> None:
    """TypeError unless `layout` is a Layout (parse strings with Layout.parse('dp2,tp2'))."""
    if not isinstance(layout, Layout):
        hint = " (parse a string with real_py.Layout.parse)" if isinstance(layout, str) else ""
        raise TypeError(
            f"{arg} must be a real_py.Layout{hint}, got {type(layout).__name__} {_short(layout)}"
        )


def check_fits(model: ModelSpec, layout: Layout) -> None:
    """Raise ValueError when the layout cannot hold the model (tp, pp, explicit partition)."""
    require_spec(model)
    require_layout(layout)
    model.check_tp(layout.tp)
    check_experts(model, layout)
    if layout.pp > model.num_layers:
        raise ValueError(
            f"pp={layout.pp} exceeds num_layers={model.num_layers} of {model.name}; "
            f"pick pp in 1..{model.num_layers}"
        )
    if layout.layers_per_stage is not None and sum(layout.layers_per_stage) != model.num_layers:
        raise ValueError(
            f"layers_per_stage={layout.layers_per_stage} sums to "
            f"{sum(layout.layers_per_stage)}, but {model.name} has {model.num_layers} layers"
        )
    if (
        layout.layers_per_stage is None
        and layout.partition == "layers"
        and model.num_layers % layout.pp
    ):
        raise ValueError(
            f"partition='layers' needs pp={layout.pp} to divide num_layers="
            f"{model.num_layers} of {model.name}; give layers_per_stage=... instead"
        )


def check_experts(model: ModelSpec, layout: Layout) -> None:
    """ValueError naming the field when ep / etp cannot split the model's experts."""
    experts = model.num_experts
    if not experts:
        if layout.ep > 1 or layout.etp > 1:
            raise ValueError(
                f"layout {layout} sets ep={layout.ep}, etp={layout.etp}, but {model.name} "
                "has no experts (num_experts=0); drop ep/etp"
            )
        return
    if experts % layout.ep:
        raise ValueError(f"ep={layout.ep} does not divide num_experts={experts} of {model.name}")
    for p in model.params:
        if p.expert >= 0:
            why = p.tp_error(layout.etp)
            if why:
                raise ValueError(f"etp={layout.etp}: {why} of {p.name}")
            break
