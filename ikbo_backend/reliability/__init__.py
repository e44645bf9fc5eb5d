"""Reliability and security rows against a real tritonserver, one module per row: malformed-request
storms (cases, storm), a test-only fault inside execute (fault), load generators (load), soak, stub
kill -9 under load (kill), graceful shutdown (shutdown), restricted APIs (hardening), the online
endpoints' batch isolation and queue full (online), a broken model (broken); `scripts/serve` as a
subprocess (served) and the repository copies the rows serve (repositories). Modelled on Triton's
qa/L0_input_validation, L0_backend_python (lifecycle, restart) and L0_memory_growth.

Servers run on free ports of 127.0.0.1; every loop is bounded by a count or a deadline. The short forms
run in `make test` (tests/test_reliability*.py), the long forms through scripts/reliability.py.
"""

from ..ranker import RankerConfig

CFG = RankerConfig()  # the dims of the served CPU configs
RANKERS = ("ikbo_ranker", "baseline_ranker")
PROTOCOLS = ("http", "grpc")
SERVED_STAGES = ("ranker_features", "ikbo_interaction", "baseline_interaction")  # the stubs behind RANKERS
CLIENT_ERRORS = {"http": {"400"}, "grpc": {"StatusCode.INVALID_ARGUMENT"}}
