"""Helpers shared by the test modules, none of them collected by pytest:

    oracle            the independent slicing oracle: which global elements a rank holds,
                      by index math
    schedule_oracle   the global bucket schedule (every rank's rounds at once), the C++ per-rank
                      rule's reference
    dist_cases        named and random layout pairs, and one checked transfer on gloo ranks
    models_oracle     tiny HF checkpoints and the transformers oracle of the models / engines tests
    ops_cases         the pack / unpack op tests' reference, random descriptors and named samples
    vllm_cases        the vLLM backend tests' checkpoints, engines and references
                      (skips without vLLM)
    bad_inputs_sweep  the bad-input acceptance sweep through the CLI (`make test-bad-inputs`),
                      a script

Imported as `support.<module>` (`from support.oracle import oracle_flat`): pytest puts tests/ on
sys.path (`pythonpath` in pyproject.toml), and spawned gloo ranks inherit that path, so module-level
functions of these modules and of the test modules unpickle in the children.
"""
