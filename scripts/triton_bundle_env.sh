# Sourced by the GPU run scripts: on machines without network (the lab's H200s), use the offline
# bundle .triton_bundle/tb.tar.xz from ../shared/tools/make-offline-triton-bundle.sh (tritonserver +
# stub + perf_analyzer), .triton_bundle/site (tritonclient) and .triton_bundle/whl (its HTTP
# dependencies) when present and python3 has no tritonclient; elsewhere nothing changes.
if [ -f .triton_bundle/tb.tar.xz ] && ! python3 -c "import tritonclient" 2>/dev/null; then
  mkdir -p /tmp/tb /tmp/site && tar xJf .triton_bundle/tb.tar.xz -C /tmp/tb
  python3 -m pip install -q --no-deps --no-index --target /tmp/site .triton_bundle/whl/*.whl >/dev/null 2>&1
  export TRITONSERVER=/tmp/tb/pytriton/tritonserver/bin/tritonserver PERF_ANALYZER=/tmp/tb/bin/perf_analyzer
  export PYTHONPATH="$PWD:$PWD/.triton_bundle/site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
