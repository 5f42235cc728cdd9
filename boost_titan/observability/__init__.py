"""What a run reports, and nothing else: console and TensorBoard.

    metrics         torchtitan's MetricsProcessor, every pipeline rank logging the true loss
    dashboard       the TensorBoard custom-scalars layout every run writes
    step_profile    where a step's time goes: the profiled steps and their scalars
    profile_events  a profiled step's events: intervals, collectives, FLOPs, the summary
    comm_stats      collective counts and bytes per module, forward and backward
    comm_traces     the flight recorder's folder, kept only when written to
    log_filters     warnings that are wrong on our paths, dropped by exact text
    screenshot      a run's dashboard as a PNG (``boost-titan screenshot``)
    peak_rss        a command's peak resident memory (from-dense, export print it)

It imports nothing else of boost_titan: every other folder may report through it."""
