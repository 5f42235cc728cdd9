"""Where a batch comes from.

datasets        the datasets a TOML names (``[training] dataset``): registered with
                torchtitan's text loader (start here)
loader          which tokenized corpora each section reads (raw text through the
                cache), checked and agreed on by every rank; the loaders
window_loader   the loader: each rank reads only the windows of its slice of a batch
order           the global order: blend, shuffle, who reads what (arithmetic)
tokenized       a tokenized corpus: its manifest (``corpus.json``) and the reader of its
                windows, each block of a part checked the first time it is read
part_blocks     a part's digests per 64 KiB block (``part-NNNNN.blocks``)
tokenize        ``boost-titan data tokenize``: raw text into a tokenized corpus
seal            ``boost-titan data seal``: Megatron .bin/.idx files made a corpus
indexed         Megatron's .bin/.idx format, read and written
out_folder      what tokenize and seal may write or remove in --out: our own files only
files           regular files only (no FIFO opened to block), paths resolved
cache           raw text tokenized once into a cache folder
text_sources    raw text that tokenize reads (files, saved datasets), in units
local_text      your own corpus on disk: which files, their checks, their documents
calibration     from-dense's calibration sample
tokenizer       byte-level BPE training and its checks (BOS=0, EOS=1)
user_tokenizer  a tokenizer trained on your own files (``boost-titan data tokenizer``)
corpus/         the embedded English corpus, built from pinned package artifacts
cli             ``boost-titan data build|info|tokenizer|tokenize|seal``
"""
