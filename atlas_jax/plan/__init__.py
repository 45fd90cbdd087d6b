"""atlas_jax.plan: the planner, memory and compute from a config alone (`atlas-plan`).

Pure arithmetic: nothing is built or allocated, and nothing here imports the trainer. The same
figures read off the real modules are `atlas_jax.measure`; the device table is `atlas_jax.devices`.

    from atlas_jax.plan.planner import PlanInputs, make_plan
    plan = make_plan(model_cfg, PlanInputs(seq_len=4096, devices=8, device="H100"))
"""
