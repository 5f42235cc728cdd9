"""A dense LLaMA checkpoint turned into a low-rank one (``boost-titan checkpoint
from-dense``; the command: :mod:`boost_titan.cli.from_dense`; the factor math:
:mod:`boost_titan.models.from_dense`; calibration tokens: :mod:`boost_titan.data.calibration`).

    source   the dense model, read tensor by tensor: a Hugging Face ``llama`` folder
             (safetensors, lazily) or a ``llama2`` DCP step folder of our trainer
    runner   the dense model run block by block on calibration tokens, capturing every
             projection's inputs
    convert  one block at a time: SVD factors, the activation-aware fit, LaX gates, the
             error report
    stream   the DCP step folder, written as the blocks are converted (atomically)
    report   the progress bar and the error tables
    continue_training  the command that trains on from the step (recommended lr, warm-up)
"""
