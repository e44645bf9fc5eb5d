"""IKBO ranking model, request contract and serving (no tritonserver import here: model.py files
hand `triton_python_backend_utils` in).

| module          | job                                                                          |
|-----------------|------------------------------------------------------------------------------|
| ranker          | the model: RankerConfig, profiles, weights, feature stage, IKBO and baseline  |
| variants        | the served variants (`build_ranker`: ikbo, baseline, transformed; dtypes)    |
| transformed     | the baseline after the IKBO rewrite pass (transform/, generic)               |
| requests        | the request contract and its validation; synthetic: random requests          |
| online          | the online contract (one user per request) and its batching                  |
| paths           | model repository, shape ranges, weights files                                |
| model_config    | what a config.pbtxt declares and sets, as the stages read it                 |
| stages          | the served stages (features, interaction, ranker, online) and their warm-up  |
| cuda_graphs     | CUDA-graph replays of a stage per shape bucket                               |
| python_model    | the python backend's TritonPythonModel of every model.py                     |
| metrics         | custom Prometheus metrics; compile_counter: Triton compilations by phase     |
| batch_invariant | CPU arithmetic whose rows do not depend on their batch                       |
| libc            | memmove / memset that keep the GIL                                           |
| client          | requests to a running tritonserver (tritonclient)                            |
| inprocess/      | the python_inprocess Triton backend (self-contained)                         |

Beside them: the kernels' shape buckets and tuning (shape_spec, tuning), running tritonserver
(tritonserver, instance_groups) and the benchmarks' library (perf/).
"""
