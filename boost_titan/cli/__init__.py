"""The ``boost-titan`` command, and the tools built on several folders below it.

main        ``boost-titan``: the table of every tool (start here)
checkpoint  ``boost-titan checkpoint``: export / import / verify (a parsed config,
            DCP, Hugging Face layouts), from-dense (from_dense)
args        argparse whose usage errors are one line
eval        ``boost-titan eval``: lm-eval on an exported Hugging Face folder, over the
            embedded corpus's validation split or your documents (tasks/: its task)
"""
