"""The Hydra configs, shipped as package data: every entry point composes from this folder."""
