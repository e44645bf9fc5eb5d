"""IKBO ranking model, request contract, serving and the tools around them (no tritonserver import here:
model.py files hand `triton_python_backend_utils` in).

| module | job |
|---|---|
| ranker | the model: RankerConfig, profiles, weights, feature stage, IKBO and baseline interactions |
| variants | the served variants (`build_ranker`: ikbo, baseline, transformed) and compute dtypes |
| transformed | the baseline after the IKBO rewrite pass; transform/ holds the generic pass |
| batch_invariant | CPU arithmetic whose rows do not depend on their batch |
| requests | the request contract and its validation |
| online | the online contract (one user per request) and its batching |
| synthetic | random requests of the contract (tests, warm-up, benchmarks) |
| paths | model repository, shape ranges, weights files |
| model_config | what a config.pbtxt declares and sets, as the stages read it |
| stages | the served stages (features, interaction, ranker, online) and their warm-up |
| python_model | the TritonPythonModel of every model.py |
| cuda_graphs | CUDA-graph replays of a stage per shape bucket |
| kernel_buckets | the (U, B) ranges that run one compiled kernel, per op |
| autotune | load-time tuning per bucket; tuning_cache: its disk cache and Triton's |
| metrics | custom Prometheus metrics; compile_counter: Triton compilations by phase |
| libc | memmove / memset that keep the GIL |
| inprocess/ | the python_inprocess Triton backend (self-contained) |
| model_repository | the config templates per model role; pbtxt: reading and writing configs |
| instance_groups | configs derived at serve time: GPU lists, the python backend instead of python_inprocess |
| tritonserver | finding and starting tritonserver; supervisor: `scripts/serve`'s replicas and restarts |
| process_tree, idle_cpus | a server's stubs, shared memory and RSS; CPU wake latency and busy-idle loops |
| client | requests to a running tritonserver (tritonclient) |
| perf/ | device timing, the kernel benchmark harness, perf_analyzer runs, serving probes |
| reliability/ | the reliability suite: malformed requests, faults, kills, shutdown, soak |
"""
