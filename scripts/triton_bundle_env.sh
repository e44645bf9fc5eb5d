# Sourced by the GPU run scripts from the repository root.
# On machines without network (the lab's H200s), use the offline bundle .triton_bundle/tb.tar.xz from
# ../shared/tools/make-offline-triton-bundle.sh (tritonserver + stub + perf_analyzer), .triton_bundle/site
# (tritonclient) and .triton_bundle/whl (its HTTP dependencies) when present and python3 has no tritonclient.
if [ -f .triton_bundle/tb.tar.xz ] && ! python3 -c "import tritonclient" 2>/dev/null; then
  mkdir -p /tmp/tb /tmp/site && tar xJf .triton_bundle/tb.tar.xz -C /tmp/tb
  python3 -m pip install -q --no-deps --no-index --target /tmp/site .triton_bundle/whl/*.whl >/dev/null 2>&1
  export TRITONSERVER=/tmp/tb/pytriton/tritonserver/bin/tritonserver PERF_ANALYZER=/tmp/tb/bin/perf_analyzer
  export PYTHONPATH="$PWD/.triton_bundle/site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The package by name: a python3 that has it not installed (the GPU machine's own) gets this tree
# installed editable, so that the python backend stubs, which ignore PYTHONPATH, import it too; and the
# tree on PYTHONPATH for `python3 scripts/...` should that install fail.
if ! (cd / && env -u PYTHONPATH python3 -c "import ikbo_backend, kernels") 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
    || echo "triton_bundle_env.sh: could not install this tree into $(command -v python3)" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
