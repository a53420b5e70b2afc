// Renders formulas with KaTeX at build time: reads [[tex, display], ...] as JSON on stdin, writes
// [{"html": ...} | {"error": ...}, ...] on stdout. argv[2]: the path of katex.min.js.
const katex = require(process.argv[2]);
let input = "";
process.stdin.on("data", (chunk) => (input += chunk));
process.stdin.on("end", () => {
  const out = JSON.parse(input).map(([tex, display]) => {
    try {
      return { html: katex.renderToString(tex, { displayMode: display, throwOnError: true, strict: "ignore", output: "htmlAndMathml" }) };
    } catch (err) {
      return { error: String(err.message || err) };
    }
  });
  process.stdout.write(JSON.stringify(out));
});
