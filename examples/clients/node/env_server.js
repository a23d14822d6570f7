#!/usr/bin/env node
// An rlfabric environment written in Node.js: EnvironmentService (protos/rlfabric/v1/environment.proto)
// served with @grpc/grpc-js, the proto loaded at run time. A rollout talks to it as to the Python env
// service: sessions with ids, Reset -> first observation, Step -> observation, reward, done, Close.
//
//   node env_server.js [HOST:PORT]     serve GuessTheNumber (default 127.0.0.1:0); prints "listening on HOST:PORT"
//
// Environment: RLFABRIC_TOKEN (require this bearer token on every call), RLFABRIC_PROTO_DIR (default: the
// repo's protos/), RLFABRIC_ENV_IDLE_TIMEOUT_S (close sessions idle this long, default 300),
// RLFABRIC_ENV_STEP_TIMEOUT_S (longest Reset or Step, default 30).
//
// To serve your own environment: require this file and call serveEnvironments({name: Class}, options);
// a class is built per session from the task, and has `tools`, `reset()` and `step(action)` (either
// may return a promise). What they return is sent as it is: the caller checks it against the contract.
"use strict";

const crypto = require("node:crypto");
const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_DIR = process.env.RLFABRIC_PROTO_DIR || path.resolve(__dirname, "../../../protos");

// A failure with a gRPC status code, answered to the caller as that status.
class StatusError extends Error {
  constructor(code, details) {
    super(details);
    this.code = code;
    this.details = details;
  }
}

// The example: guess the task's ground truth (an integer) with the tool guess(number), which answers
// "higher", "lower" or "correct"; then answer "#### N" (reward 1 when N is the number).
class GuessTheNumber {
  constructor(task) {
    this.secret = Number.parseInt(task.ground_truth, 10);
    if (Number.isNaN(this.secret)) {
      throw new StatusError(grpc.status.INVALID_ARGUMENT, "guess: the task's ground_truth must be an integer");
    }
    this.guesses = 0;
    this.tools = [
      {
        name: "guess",
        description: "Says whether the secret number is higher, lower or correct.",
        parameters_json: JSON.stringify({
          type: "object",
          properties: { number: { type: "integer", description: "Your guess." } },
          required: ["number"],
        }),
      },
    ];
  }

  reset() {
    return [{ role: "user", content: "I am thinking of a number. Call guess(number) to narrow it down." }];
  }

  step(action) {
    if (action.tool_calls.length === 0) {
      const answer = /#### (-?\d+)/.exec(action.text);
      const reward = answer && Number(answer[1]) === this.secret ? 1 : 0;
      return { observation: { messages: [] }, reward, done: true, status: "STEP_STATUS_OK",
               metrics: { guesses: this.guesses } };
    }
    const messages = [];
    let status = "STEP_STATUS_OK";
    for (const call of action.tool_calls) {
      const [callStatus, output] = this.runTool(call);
      if (status === "STEP_STATUS_OK") status = callStatus;
      messages.push({ role: "tool", content: output });
    }
    return { observation: { messages }, reward: 0, done: false, status, metrics: {} };
  }

  runTool(call) {
    if (call.name !== "guess") return ["STEP_STATUS_UNKNOWN_TOOL", `error: unknown tool '${call.name}'; tools: guess`];
    let args;
    try {
      args = JSON.parse(call.arguments_json || "{}");
    } catch (error) {
      return ["STEP_STATUS_INVALID_ARGUMENTS", `error: the arguments of guess are not JSON: ${error.message}`];
    }
    if (!Number.isInteger(args?.number)) {
      return ["STEP_STATUS_INVALID_ARGUMENTS", "error: guess takes {\"number\": an integer}"];
    }
    this.guesses += 1;
    if (args.number === this.secret) return ["STEP_STATUS_OK", "correct"];
    return ["STEP_STATUS_OK", args.number < this.secret ? "higher" : "lower"];
  }
}

// grpc.health.v1.Health (its proto is not in this repository), so launchers and `rlfabric train --attach`
// see the service ready as they see rlfabric's own: "", "liveness" and "readiness" are SERVING.
const HEALTH_PROTO = {
  nested: { grpc: { nested: { health: { nested: { v1: { nested: {
    HealthCheckRequest: { fields: { service: { type: "string", id: 1 } } },
    HealthCheckResponse: {
      fields: { status: { type: "ServingStatus", id: 1 } },
      nested: { ServingStatus: { values: { UNKNOWN: 0, SERVING: 1, NOT_SERVING: 2, SERVICE_UNKNOWN: 3 } } },
    },
    Health: { methods: { Check: { requestType: "HealthCheckRequest", responseType: "HealthCheckResponse" } } },
  } } } } } } },
};
const HEALTHY = new Set(["", "liveness", "readiness", "rlfabric.v1.EnvironmentService"]);

function healthService() {
  const definition = protoLoader.fromJSON(HEALTH_PROTO, { keepCase: true, enums: String, defaults: true });
  const Health = grpc.loadPackageDefinition(definition).grpc.health.v1.Health;
  const check = (call, callback) => {
    if (HEALTHY.has(call.request.service)) callback(null, { status: "SERVING" });
    else callback({ code: grpc.status.NOT_FOUND, details: `unknown service '${call.request.service}'` });
  };
  return [Health.service, { Check: check }];
}

function loadEnvironmentService() {
  const definition = protoLoader.loadSync("rlfabric/v1/environment.proto", {
    includeDirs: [PROTO_DIR],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
  });
  return grpc.loadPackageDefinition(definition).rlfabric.v1.EnvironmentService;
}

// `promise`, or a DEADLINE_EXCEEDED StatusError after `seconds`.
function within(seconds, promise, what) {
  let timer;
  const late = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new StatusError(grpc.status.DEADLINE_EXCEEDED,
      `${what} ran past ${seconds} s; the session is closed`)), seconds * 1000);
  });
  return Promise.race([Promise.resolve(promise), late]).finally(() => clearTimeout(timer));
}

// The session table and the four calls; `environments` maps names to classes (the first is the default).
class Sessions {
  constructor(environments, options) {
    this.environments = environments;
    this.defaultName = Object.keys(environments)[0];
    this.options = options;
    this.open = new Map(); // id -> {environment, name, lastUsed, done, busy}
    this.closedWhy = new Map(); // id -> why the service closed it (the last 10000)
    this.started = 0;
    this.expired = 0;
    this.steps = 0;
  }

  async reset(request) {
    if (this.open.size >= this.options.maxSessions) {
      throw new StatusError(grpc.status.RESOURCE_EXHAUSTED, `${this.options.maxSessions} sessions are open, the limit`);
    }
    const task = request.task || {};
    const name = task.environment || this.defaultName;
    const Environment = this.environments[name];
    if (!Environment) {
      throw new StatusError(grpc.status.INVALID_ARGUMENT,
        `unknown environment '${name}'; registered: ${Object.keys(this.environments).join(", ")}`);
    }
    let extraInfo = {};
    try {
      extraInfo = task.extra_info_json ? JSON.parse(task.extra_info_json) : {};
    } catch (error) {
      throw new StatusError(grpc.status.INVALID_ARGUMENT, `task.extra_info_json is not JSON: ${error.message}`);
    }
    const environment = new Environment({ ...task, extra_info: extraInfo });
    const messages = await within(this.options.stepTimeoutS, environment.reset(), `environment '${name}': Reset`);
    const id = crypto.randomUUID().replaceAll("-", "");
    this.open.set(id, { environment, name, lastUsed: Date.now(), done: false, busy: false });
    this.started += 1;
    return { session_id: id, observation: { messages }, tools: environment.tools };
  }

  async step(request) {
    const action = request.action || { text: "", tool_calls: [] };
    const size = Buffer.byteLength(action.text) +
      action.tool_calls.reduce((sum, c) => sum + Buffer.byteLength(c.name) + Buffer.byteLength(c.arguments_json), 0);
    if (size > this.options.maxActionBytes) {
      throw new StatusError(grpc.status.RESOURCE_EXHAUSTED,
        `the action has ${size} bytes; the limit is ${this.options.maxActionBytes}`);
    }
    const session = this.session(request.session_id);
    if (session.done) throw new StatusError(grpc.status.FAILED_PRECONDITION, `session ${request.session_id} is done`);
    if (session.busy) throw new StatusError(grpc.status.FAILED_PRECONDITION, `session ${request.session_id} is running a Step already`);
    session.busy = true;
    let result;
    try {
      result = await within(this.options.stepTimeoutS, session.environment.step(action), `environment '${session.name}': Step`);
    } catch (error) {
      this.drop(request.session_id, "its Step failed");
      throw error;
    }
    Object.assign(session, { busy: false, done: Boolean(result.done), lastUsed: Date.now() });
    this.steps += 1;
    return result;
  }

  close(request) {
    this.session(request.session_id);
    this.drop(request.session_id, "it was closed by a Close call");
    return {};
  }

  status() {
    return { environments: Object.keys(this.environments), sessions_open: this.open.size,
             sessions_started: this.started, sessions_expired: this.expired, steps: this.steps };
  }

  closeIdleSessions() {
    const now = Date.now();
    for (const [id, session] of this.open) {
      if (!session.busy && now - session.lastUsed > this.options.idleTimeoutS * 1000) {
        this.drop(id, `it idled past ${this.options.idleTimeoutS} s`);
        this.expired += 1;
      }
    }
  }

  session(id) {
    const session = this.open.get(id);
    if (session) return session;
    const why = this.closedWhy.get(id);
    throw new StatusError(grpc.status.NOT_FOUND, why ? `session '${id}' was closed: ${why}` : `no session '${id}'`);
  }

  drop(id, why) {
    const session = this.open.get(id);
    if (!session) return;
    this.open.delete(id);
    this.closedWhy.set(id, why);
    if (this.closedWhy.size > 10_000) this.closedWhy.delete(this.closedWhy.keys().next().value);
    session.environment.close?.();
  }
}

// Serves `environments` on options.address; resolves to {server, port, sessions}.
function serveEnvironments(environments, options = {}) {
  const settings = {
    address: "127.0.0.1:0",
    token: process.env.RLFABRIC_TOKEN || "",
    idleTimeoutS: Number(process.env.RLFABRIC_ENV_IDLE_TIMEOUT_S || 300),
    stepTimeoutS: Number(process.env.RLFABRIC_ENV_STEP_TIMEOUT_S || 30),
    maxSessions: 1024,
    maxActionBytes: 65536,
    ...options,
  };
  const sessions = new Sessions(environments, settings);
  // Each call: check the token, run the handler, answer its result or its status.
  const handle = (method) => (call, callback) => {
    const given = call.metadata.get("authorization")[0];
    if (settings.token && given !== `Bearer ${settings.token}`) {
      callback({ code: grpc.status.UNAUTHENTICATED, details: "missing or wrong bearer token" });
      return;
    }
    Promise.resolve()
      .then(() => sessions[method](call.request))
      .then((response) => callback(null, response))
      .catch((error) => callback({ code: error.code ?? grpc.status.INTERNAL, details: error.details ?? String(error) }));
  };
  const server = new grpc.Server();
  server.addService(loadEnvironmentService().service, {
    Reset: handle("reset"), Step: handle("step"), Close: handle("close"), GetStatus: handle("status"),
  });
  server.addService(...healthService()); // no token needed, as rlfabric's own health services
  const reaper = setInterval(() => sessions.closeIdleSessions(), Math.min(1000, settings.idleTimeoutS * 250));
  reaper.unref();
  return new Promise((resolve, reject) => {
    server.bindAsync(settings.address, grpc.ServerCredentials.createInsecure(), (error, port) => {
      if (error) reject(error);
      else resolve({ server, port, sessions });
    });
  });
}

async function main(argv) {
  const address = argv[0] || "127.0.0.1:0";
  const { port } = await serveEnvironments({ guess: GuessTheNumber }, { address });
  const host = address.slice(0, address.lastIndexOf(":"));
  console.log(`listening on ${host}:${port}`);
}

module.exports = { serveEnvironments, GuessTheNumber, StatusError };

if (require.main === module) {
  main(process.argv.slice(2)).catch((error) => {
    console.error(`error: ${error.message}`);
    process.exitCode = 1;
  });
}
