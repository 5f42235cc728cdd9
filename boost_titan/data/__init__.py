"""Where a batch comes from.

    datasets        the datasets a TOML names (``[training] dataset``): registered with
                    torchtitan's text loader (start here)
    local_text      your own corpus on disk: which files, the checks before the model is
                    built, the documents read from them (the one reader of corpus files)
    loader          the data loaders of ``local_text``: streamed or map-style, sharded
                    over data-parallel ranks, resumable
    workers         DataLoader workers: refused over a map-style dataset
    fingerprint     which files a streamed position was saved over, checked on resume
    tokenizer       byte-level BPE training and its checks (BOS=0, EOS=1)
    user_tokenizer  a tokenizer trained on your own files (``boost-titan data tokenizer``)
    corpus/         the embedded English corpus, built from pinned package artifacts
    cli             ``boost-titan data build|info|tokenizer``
"""
