"""Ray Serve applications. Each module exposes an application builder for Serve configs
(`import_path: workloads.serve.<app>:app_builder`); nothing runs at import time."""
