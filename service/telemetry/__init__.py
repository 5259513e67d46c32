"""Logs, metrics and health: how the service is watched."""
