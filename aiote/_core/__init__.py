"""The core layer: engine, memory, descriptors, counters, errors and the event-loop bridge.

Imports only ``aiote._native`` below it; flows and the CLI build on it."""
