"""The explorer: turns tasks into scored experiences with an inference engine."""
