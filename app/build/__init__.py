"""Building the Serve application from the YAML's `args:` (`import_path: app.build:build_app`).

`build_app` is imported on first use: the pure modules of this package (placement, options' sizing) load without Ray.
"""


def __getattr__(name: str):
    if name == "build_app":
        from app.build.builder import build_app

        return build_app
    raise AttributeError(name)
