"""Import stand-in for the closed Neuron SDK module `neuronxcc`: see neuron_sdk_standin (nothing here runs Neuron code)."""

import sys

from neuron_sdk_standin import stand_in

stand_in(sys.modules[__name__])
