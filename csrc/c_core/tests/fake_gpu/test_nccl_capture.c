/*
 * test_nccl_capture.c - CUDA ops issued while the caller's stream captures
 * a CUDA graph, through the fake runtime (whose capture refuses what real
 * capture refuses: event queries on captured work, unjoined streams,
 * unsafe calls) and the fake NCCL (whose work replays once per launch).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../check.h"
#include "../group.h"
#include "gpu_rank.h"

#define COUNT 45

static void fill(gpu_rank_t *g, float *d, double scale) {
  float in[COUNT];
  for (int i = 0; i < COUNT; i++) in[i] = (float)(input_value(g->rank, (size_t)i) * scale);
  upload(g, d, in, sizeof in);
}

/* An allreduce and a send/recv ring captured once, replayed three times
 * with new inputs: every replay reduces and moves the inputs of its time. */
static void rank_capture_replay(tcc_comm_t *comm) {
  alarm(120);
  gpu_rank_t g = gpu_rank_open(comm);
  const int next = (g.rank + 1) % g.size, prev = (g.rank + g.size - 1) % g.size;
  float *d = dev_alloc(COUNT * 4), *s = dev_alloc(COUNT * 4), *r = dev_alloc(COUNT * 4), out[COUNT];
  tcc_buf_t b = dbuf(&g, d, COUNT, TCC_FLOAT32), bs = dbuf(&g, s, COUNT, TCC_FLOAT32), br = dbuf(&g, r, COUNT, TCC_FLOAT32);
  /* NCCL is set up outside the capture, by the same ops once. */
  tcc_op_t *o = NULL, *os = NULL, *orr = NULL;
  fill(&g, d, 1);
  settle(&g, tcc_allreduce(comm, b, b, TCC_SUM, NULL, &o), &o, "warm-up allreduce");
  CHECK(tcc_comm_group_start(comm) == TCC_OK, "group start");
  tcc_result_t r1 = tcc_send(comm, bs, next, 0, NULL, &os), r2 = tcc_recv(comm, br, prev, 0, NULL, &orr);
  CHECK(tcc_comm_group_end(comm) == TCC_OK, "group end: %s", tcc_last_error());
  settle(&g, r1, &os, "warm-up send");
  settle(&g, r2, &orr, "warm-up recv");
  gpu_sync(&g);

  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  CHECK(cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeGlobal) == cudaSuccess, "begin capture");
  o = NULL;
  tcc_result_t ri = tcc_allreduce(comm, b, b, TCC_SUM, NULL, &o);
  CHECK(ri == TCC_OK, "allreduce in capture: %s", tcc_last_error());
  if (ri == TCC_OK) {
    /* Complete at once from the host: the graph owns the work. */
    CHECK(tcc_op_test(o) == 1 && tcc_op_result(o) == TCC_OK, "a captured op is complete from the host's view");
    CHECK(tcc_op_stream_wait(o, g.stream) == TCC_OK, "join back: %s", tcc_op_error(o));
    tcc_op_release(o);
  }
  os = orr = NULL;
  CHECK(tcc_comm_group_start(comm) == TCC_OK, "group start");
  r1 = tcc_send(comm, b, next, 0, NULL, &os);
  r2 = tcc_recv(comm, br, prev, 0, NULL, &orr);
  CHECK(tcc_comm_group_end(comm) == TCC_OK, "group end in capture: %s", tcc_last_error());
  if (r1 == TCC_OK && os) {
    CHECK(tcc_op_stream_wait(os, g.stream) == TCC_OK, "join send");
    tcc_op_release(os);
  }
  if (r2 == TCC_OK && orr) {
    CHECK(tcc_op_stream_wait(orr, g.stream) == TCC_OK, "join recv");
    tcc_op_release(orr);
  }
  cudaError_t e = cudaStreamEndCapture(g.stream, &graph);
  CHECK(e == cudaSuccess, "end capture: %s", cudaGetErrorString(e));
  if (e == cudaSuccess) CHECK(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess, "instantiate");
  for (int k = 1; exec && k <= 3; k++) {
    fill(&g, d, k);
    CHECK(cudaGraphLaunch(exec, g.stream) == cudaSuccess, "launch %d", k);
    download(&g, out, d, sizeof out);
    for (int i = 0; i < COUNT; i++)
      CHECK(out[i] == (float)(k * reduced_value(g.size, (size_t)i, TCC_FLOAT32, TCC_SUM, 0)), "replay %d allreduce [%d]", k, i);
    /* the ring moved the reduced values: every rank holds the same */
    download(&g, out, r, sizeof out);
    for (int i = 0; i < COUNT; i++)
      CHECK(out[i] == (float)(k * reduced_value(g.size, (size_t)i, TCC_FLOAT32, TCC_SUM, 0)), "replay %d recv [%d]", k, i);
  }
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  cudaFree(d);
  cudaFree(s);
  cudaFree(r);
  gpu_rank_close(&g);
}

/* The first collective of a group inside a capture: NCCL's setup cannot be
 * captured, so the op is refused with a clear error and the capture is
 * left intact. */
static void rank_first_op_in_capture(tcc_comm_t *comm) {
  alarm(120);
  gpu_rank_t g = gpu_rank_open(comm);
  float *d = dev_alloc(COUNT * 4);
  tcc_buf_t b = dbuf(&g, d, COUNT, TCC_FLOAT32);
  CHECK(cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeGlobal) == cudaSuccess, "begin capture");
  tcc_op_t *o = NULL;
  tcc_result_t r = tcc_allreduce(comm, b, b, TCC_SUM, NULL, &o);
  CHECK(r == TCC_ERR_INVALID && strstr(tcc_last_error(), "capturing") && strstr(tcc_last_error(), "allreduce") &&
            strstr(tcc_last_error(), "fake-gpu-capture"),
        "first allreduce in capture on rank %d: %d %s", g.rank, r, tcc_last_error());
  if (r == TCC_OK) tcc_op_release(o);
  cudaGraph_t graph = NULL;
  cudaError_t e = cudaStreamEndCapture(g.stream, &graph);
  CHECK(e == cudaSuccess, "the refused op left the capture broken: %s", cudaGetErrorString(e));
  if (graph) cudaGraphDestroy(graph);
  /* Outside the capture the group works. */
  fill(&g, d, 1);
  o = NULL;
  if (settle(&g, tcc_allreduce(comm, b, b, TCC_SUM, NULL, &o), &o, "allreduce after the capture") == 0) {
    float out[COUNT];
    download(&g, out, d, sizeof out);
    for (int i = 0; i < COUNT; i++)
      CHECK(out[i] == (float)reduced_value(g.size, (size_t)i, TCC_FLOAT32, TCC_SUM, 0), "allreduce [%d]", i);
  }
  cudaFree(d);
  gpu_rank_close(&g);
}

/* A graph outlives the communicator its work was captured on: it replays
 * after destroy (its NCCL communicator is kept for it), and NCCL goes when
 * the graph does. */
static void rank_replay_after_destroy(tcc_comm_t *comm) {
  alarm(120);
  gpu_rank_t g = gpu_rank_open(comm);
  float *d = dev_alloc(COUNT * 4), out[COUNT];
  tcc_buf_t b = dbuf(&g, d, COUNT, TCC_FLOAT32);
  tcc_op_t *o = NULL;
  fill(&g, d, 1);
  settle(&g, tcc_allreduce(comm, b, b, TCC_SUM, NULL, &o), &o, "warm-up allreduce");
  gpu_sync(&g);
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  CHECK(cudaStreamBeginCapture(g.stream, cudaStreamCaptureModeGlobal) == cudaSuccess, "begin capture");
  o = NULL;
  settle(&g, tcc_allreduce(comm, b, b, TCC_SUM, NULL, &o), &o, "allreduce in capture");
  CHECK(cudaStreamEndCapture(g.stream, &graph) == cudaSuccess, "end capture");
  if (graph) CHECK(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess, "instantiate");
  tcc_comm_destroy(comm);
  group_comm_destroyed = 1;
  CHECK(fake_nccl_comms_alive() == 1, "the graph's NCCL communicator went with the group: %d alive",
        fake_nccl_comms_alive());
  for (int k = 1; exec && k <= 2; k++) {
    fill(&g, d, k);
    CHECK(cudaGraphLaunch(exec, g.stream) == cudaSuccess, "launch %d after destroy", k);
    download(&g, out, d, sizeof out);
    for (int i = 0; i < COUNT; i++)
      CHECK(out[i] == (float)(k * reduced_value(g.size, (size_t)i, TCC_FLOAT32, TCC_SUM, 0)),
            "replay %d after destroy [%d]", k, i);
  }
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  /* The last holder gone, NCCL is released (on a thread of the core). */
  for (int t = 0; t < 500 && fake_nccl_comms_alive() > 0; t++) usleep(10000);
  CHECK(fake_nccl_comms_alive() == 0, "%d NCCL communicator(s) left after the graph went", fake_nccl_comms_alive());
  cudaFree(d);
  gpu_rank_close(&g);
}

int main(void) {
  alarm(300);
  CHECK(run_group(2, "shm", 10000, "fake-gpu-capture", rank_capture_replay) == 0, "capture and replay, 2 ranks");
  CHECK(run_group(3, "shm", 10000, "fake-gpu-capture", rank_capture_replay) == 0, "capture and replay, 3 ranks");
  CHECK(run_group(2, "shm", 10000, "fake-gpu-capture", rank_first_op_in_capture) == 0, "first op in capture");
  CHECK(run_group(2, "shm", 10000, "fake-gpu-capture", rank_replay_after_destroy) == 0, "replay after destroy");
  CHECK_DONE();
}
