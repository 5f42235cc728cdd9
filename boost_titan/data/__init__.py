"""Where a batch comes from.

datasets        the datasets a TOML names (``[training] dataset``): registered with
                torchtitan's text loader (start here)
local_text      your own corpus on disk: which files, the checks before the model is
                built, the documents read from them (the one reader of corpus files)
loader          which loader reads training (the global order) and validation (a
                rank's share of ``local_text``; torchtitan's for the rest)
order           the global order of packed windows: each rank's slice of a global
                batch, the position that resumes it at any dp degree (arithmetic)
sources         the documents of the global order, read from a position
global_loader   the training loader: every rank packs the whole stream, keeps its
                slice; DataLoader workers tokenize chunks in turn
workers         DataLoader workers of torchtitan's loaders: refused over map-style data
fingerprint     which files a streamed position was saved over, checked on resume
tokenizer       byte-level BPE training and its checks (BOS=0, EOS=1)
user_tokenizer  a tokenizer trained on your own files (``boost-titan data tokenizer``)
corpus/         the embedded English corpus, built from pinned package artifacts
cli             ``boost-titan data build|info|tokenizer``
"""
