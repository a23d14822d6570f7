#!/usr/bin/env node
// Starts a training run on an rlfabric coordinator and follows it until it ends.
//
//   node run.js HOST:PORT [key=value ...]    StartRun (with dotted config overrides), one line per
//                                            finished step from StreamMetrics, then GetRunStatus
//   node run.js HOST:PORT --status-only      GetRunStatus only, printed as JSON
//
// Environment: RLFABRIC_TOKEN (bearer token, the content of server.auth_token_file),
// RLFABRIC_CA_FILE (PEM CA to verify a TLS coordinator), RLFABRIC_PROTO_DIR (default: the repo's protos/).
// Exit status: 0 when the run completed (or the status was read), 1 when the run failed or was stopped
// or an RPC failed (the gRPC status name is printed), 2 on bad usage.
"use strict";

const fs = require("node:fs");
const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_DIR = process.env.RLFABRIC_PROTO_DIR || path.resolve(__dirname, "../../../protos");
const UNARY_DEADLINE_MS = 30_000;
// A few metrics per step line (VeRL names); every metric is in the stream.
const LINE_KEYS = ["critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "response_length/mean", "timing_s/step"];

function loadCoordinatorService() {
  const definition = protoLoader.loadSync("rlfabric/v1/coordinator.proto", {
    includeDirs: [PROTO_DIR],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
  });
  return grpc.loadPackageDefinition(definition).rlfabric.v1.CoordinatorService;
}

function connect(address) {
  const CoordinatorService = loadCoordinatorService();
  const ca = process.env.RLFABRIC_CA_FILE;
  const credentials = ca ? grpc.credentials.createSsl(fs.readFileSync(ca)) : grpc.credentials.createInsecure();
  const metadata = new grpc.Metadata();
  if (process.env.RLFABRIC_TOKEN) {
    metadata.add("authorization", `Bearer ${process.env.RLFABRIC_TOKEN}`);
  }
  return { client: new CoordinatorService(address, credentials), metadata };
}

// One unary call as a promise, with a deadline.
function unary(coordinator, method, request) {
  const deadline = new Date(Date.now() + UNARY_DEADLINE_MS);
  return new Promise((resolve, reject) => {
    coordinator.client[method](request, coordinator.metadata, { deadline }, (error, response) => {
      if (error) {
        error.method = method;
        reject(error);
      } else {
        resolve(response);
      }
    });
  });
}

function stepLine(message, totalSteps) {
  const shown = LINE_KEYS.filter((key) => key in message.metrics).map(
    (key) => `${key}=${Number(message.metrics[key].toPrecision(4))}`,
  );
  return [`step ${message.step}/${totalSteps}`, ...shown].join(" ");
}

// Prints every finished step from `fromStep` on; the stream ends when the run does.
async function followMetrics(coordinator, fromStep, totalSteps) {
  let nextStep = fromStep;
  const stream = coordinator.client.StreamMetrics({ from_step: String(nextStep) }, coordinator.metadata);
  try {
    for await (const message of stream) {
      console.log(stepLine(message, totalSteps));
      nextStep = Number(message.step) + 1;
    }
  } catch (error) {
    error.method = "StreamMetrics";
    throw error;
  }
  return nextStep;
}

async function main(argv) {
  const [address, ...rest] = argv;
  if (!address || address.startsWith("-")) {
    console.error("usage: node run.js HOST:PORT [key=value ...] | node run.js HOST:PORT --status-only");
    return 2;
  }
  const coordinator = connect(address);
  try {
    if (rest.includes("--status-only")) {
      console.log(JSON.stringify(await unary(coordinator, "GetRunStatus", {})));
      return 0;
    }
    const started = await unary(coordinator, "StartRun", { overrides: rest });
    console.log(`run ${started.run_id} started at step ${started.start_step}`);
    let status = await unary(coordinator, "GetRunStatus", {});
    let nextStep = Number(started.start_step) + 1;
    // The run is over once the stream ends and the status says so; a stream cut short is reopened.
    for (;;) {
      const reached = await followMetrics(coordinator, nextStep, status.total_steps);
      status = await unary(coordinator, "GetRunStatus", {});
      if (status.state !== "RUN_STATE_RUNNING" && status.state !== "RUN_STATE_PAUSED") break;
      if (reached === nextStep) await new Promise((resolve) => setTimeout(resolve, 1000));
      nextStep = reached;
    }
    if (status.state === "RUN_STATE_COMPLETED") {
      console.log(`run ${status.run_id} completed: step ${status.step}/${status.total_steps}`);
      return 0;
    }
    console.error(`run ${status.run_id} ended ${status.state} at step ${status.step}: ${status.error || "no error given"}`);
    return 1;
  } catch (error) {
    if (error.code === undefined) throw error; // not a gRPC error: a bug, let Node print the trace
    console.error(`error: ${error.method}: ${grpc.status[error.code]}: ${error.details}`);
    return 1;
  } finally {
    coordinator.client.close();
  }
}

main(process.argv.slice(2)).then((code) => {
  process.exitCode = code;
});
