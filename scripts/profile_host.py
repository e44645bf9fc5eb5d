#!/usr/bin/env python3
"""Host time of eager IKBO calls and where it goes (ikbo_backend/perf/host_profile.py): GPU only."""

from ikbo_backend.perf.host_profile import main

if __name__ == "__main__":
    main()
