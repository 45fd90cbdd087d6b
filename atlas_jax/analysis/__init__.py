"""atlas_jax.analysis: the planner (memory and compute from a config, `atlas-plan`) and the
measurements it is checked against.

    from atlas_jax.analysis.planner import PlanInputs, make_plan
    plan = make_plan(model_cfg, PlanInputs(seq_len=4096, devices=8, device="H100"))
"""
