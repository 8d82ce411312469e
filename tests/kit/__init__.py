"""Test kit: helpers and workloads the tests (and the emulator's calibration benchmark) share, kept out of the
installed package."""
