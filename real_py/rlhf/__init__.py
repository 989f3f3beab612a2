"""PPO / GRPO dataflow runtime: calls on their own layouts, weights reallocated between calls.

The graph, execution plans and batch rules it runs by are in real_py.dataflow."""

__all__: list[str] = []
