"""Measuring the ops and the served models: device timing, benchmark harness, perf_analyzer inputs and runs."""
