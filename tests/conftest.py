import os

# Tests run on loopback with auth off, whatever the developer's shell says (see FACTS: token auth turns itself on).
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
