"""Shared test helpers: harnesses and fixtures-as-functions that several test files use."""
