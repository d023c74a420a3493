"""Engine side of the data path (staging buffers, gather/scatter, NIXL).

Filled by the gpu_staging issue. Imports client, protocol and torch; torch and
nixl are imported lazily so the store never needs them.
"""
