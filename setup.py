"""The server distribution's package layout (the rest of its metadata is pyproject.toml).

The server's code lives in services/ but installs as `squall_server`, so nothing puts a
generic top-level `services` in site-packages: every package under services/ is mapped to
the same path under squall_server. Computed here, so a new subpackage needs no edit.
"""

from setuptools import find_packages, setup

setup(
    package_dir={"squall_server": "services"},
    packages=[
        "squall_server",
        *(f"squall_server.{name}" for name in find_packages("services")),
    ],
)
