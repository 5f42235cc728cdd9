"""Model state on disk: everything that writes, checks or reads a checkpoint.

    manager        torchtitan's CheckpointManager with what it leaves silent done (start here)
    save           a save that fails on the disk ends the run in one line
    space          bytes a checkpoint takes; whether the disk holds the ones a run keeps
    folder         a checkpoint folder's complete steps and what each holds
    lock           one run per checkpoint folder (a flock rank 0 holds for the run)
    run_id         which run a checkpoint folder and each of its steps belong to
    integrity/     sealed steps: a manifest written by every save, every step opened
                   through it before anything is read, every item checked; ``verify``
    safe_metadata  DCP's pickles read with allowlists: loading runs no code
    data_position  the data loader's position in a step, checked before DCP reads it
    files          files and folders that appear whole or not at all; safetensors files
                   read with damage said in one line
    export         a step's model weights to one safetensors file and back, a block at a time
    safetensors_stream  a safetensors file written a tensor at a time
    model_tokenizer     a converted model's own tokenizer, carried in its step folder
    hf/            Hugging Face layouts, folders, torchtitan's adapters

The command line is ``boost-titan checkpoint`` (:mod:`boost_titan.cli.checkpoint`)."""
