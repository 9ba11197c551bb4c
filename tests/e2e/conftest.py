"""End-to-end tests run the services as real processes; they need the whole engine stack."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("services.scheduler.async_engine") else ["test_*.py"]
