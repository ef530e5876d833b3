"""The tensor layer model code is written against: Backend, Context, Tensor, devices and memory reports.

Shapes are in ggml order, fastest dimension first (see tensor.py).
"""

from .compute_threads import compute_here
from .context import Context
from .device import Device, cpu_device, devices, gpu_devices, on_first_gpu
from .memory import BackendMemory, DeviceID, DeviceMemory, GPULayers, GPULayersList, NoMemory
from .model_backend import Backend, Placement, TensorCapture, TensorGroups
from .tensor import DType, RopeOptions, ShapeError, Tensor, hadamard_matrix

__all__ = [
    "Backend", "BackendMemory", "Context", "DType", "Device", "DeviceID", "DeviceMemory", "GPULayers",
    "GPULayersList", "NoMemory", "Placement", "RopeOptions", "ShapeError", "Tensor", "TensorCapture", "TensorGroups",
    "compute_here", "cpu_device", "devices", "gpu_devices", "on_first_gpu", "hadamard_matrix",
]
