"""Side-by-side benchmark of the TP plans (``boost-titan bench``; flags and
outputs in :mod:`boost_titan.perf.bench.cli`). One module per job:

    variants     the variants (model, plan, options), Shape/SMOKE, building one, one step of it
    worker       the per-rank timing worker: warm-up, interleaved timed steps, raw.json
    activations  bytes autograd saves from forward to backward (exact)
    comm         collectives counted and timed (comm_stats' hook; profiler when compiled)
    stats        raw timings -> results.json summary, ratios, compiled vs eager
    report       results.md, PNG charts, TensorBoard scalars
    gemm         GEMM mode: per-rank GEMMs of each plan, timed on one device
    cli          argument parsing and the run (``__main__`` calls it)
"""
