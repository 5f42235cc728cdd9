"""A training job: what it is made of and how it runs.

    trainer       torchtitan's Trainer with boost_titan's run behaviour; main() and
                  install() (the one place a training process patches torchtitan/DCP)
    specs         the train specs (models, loaders, optimizers, adapters) registered
                  with torchtitan by name
    config_check/ every config value checked before anything runs, one line each
    config_file   TOML files with ``extends``
    launch_check  the config checked once before torchrun (run_train.sh; ``boost-titan
                  check-config``)
    fault         preemption, non-finite steps, cut-off checkpoints, fault injection
    replicas      torchft replica groups ([fault_tolerance]): quorum, cross-group
                  gradients, peer recovery
    semi_sync     DiLoCo and local SGD across the replica groups (semi_sync_method)
    torchrun      run_train.sh's torchrun: its failure report left out after a refusal
                  the ranks explained in one line
    replicas      torchft replica groups ([fault_tolerance]): quorum, gradients across
                  groups, recovery from a live group
    replica_launch  ``boost-titan replicas``: a lighthouse and N replica groups, each
                  its own run_train.sh

``torchrun -m boost_titan.train`` runs ``__main__`` (what ``run_train.sh`` launches)."""
