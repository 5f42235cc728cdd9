"""Speed and memory of a layout: predicted before a run, measured on a machine.

Predicted:
    plan           the exact shapes of every TP plan: collectives, GEMMs, parameters,
                   traced memory (``boost-titan plan``: plan_cli)
    step_time      the step-time model, term by term (``boost-titan step-time``: step_time_cli)
    calibration    its three efficiencies fitted to the BOOST paper or a GPU check
    hardware       the GPUs it knows (datasheets) and custom ones
    search/        the fastest layout that fits (``boost-titan search``)
    dryrun/        a config at its real world size on CPU (``boost-titan dryrun``)
    recipes        recipes/ and their table (``boost-titan recipes``)
    preload        what a fork server imports once (dry-run roles, the test launcher)
Measured:
    bench/         side-by-side benchmark of TP plans (``boost-titan bench``)
    gpu_check/     one-command check of a GPU machine (``boost-titan gpu-check``)
"""
