"""Trainer integrations: callbacks that own attach and detach and log hookprof's headline
scalars through the trainer's own loggers. None of them is needed for correct data:
`hookprof.attach(model)` alone measures the same.

    from hookprof.integrations.lightning import HookprofCallback            # Lightning
    from hookprof.integrations.huggingface import HookprofTrainerCallback   # transformers

Each submodule imports its framework when it is imported, never at `import hookprof`."""
