/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_gpu_test.h - what the GPU tests share: counting the visible GPUs without initialising
 * CUDA in the calling process (CUDA does not survive fork, and the tests fork daemons and
 * worker processes after asking).
 */
#ifndef KVP_GPU_TEST_H
#define KVP_GPU_TEST_H

/* Visible GPUs (at most 100), counted by cudaGetDeviceCount in a child process; 0 when CUDA is
 * not usable or the child cannot run. */
int kvp_gpu_count(void);

#endif
