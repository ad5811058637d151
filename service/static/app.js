// fragsearch web page: calls the JSON API and draws aligned regions as labelled boxes.
"use strict";

const PALETTE = ["#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#9a6324",
  "#469990", "#800000", "#808000", "#000075"];

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "style") Object.assign(node.style, value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

async function api(path, options) {
  const response = await fetch(path, options);
  const body = await response.json().catch(() => null);
  if (!response.ok) {
    const message = body && body.error ? body.error.message : `HTTP ${response.status}`;
    throw new Error(message);
  }
  return body;
}

function pct(value, total) {
  return `${(100 * value / Math.max(total, 1)).toFixed(3)}%`;
}

// One positioned box over an image: box [x0, y0, x1, y1] in image pixels, labels [{text, colour}];
// `name`: the detector's name for the region (the API's `label`: "dog"), shown in its bottom corner.
function boxDiv(box, width, height, labels, whole, name = null) {
  const [x0, y0, x1, y1] = box;
  const colour = labels[0].colour;
  const div = el("div", {
    class: whole ? "box whole" : "box",
    style: { left: pct(x0, width), top: pct(y0, height), width: pct(x1 - x0, width),
      height: pct(y1 - y0, height), borderColor: colour },
  });
  const stack = el("div", { class: "labels" });
  for (const label of labels) {
    stack.append(el("span", { class: "label", title: label.title, style: { background: label.colour } },
      label.text));
  }
  div.append(stack);
  if (name) div.append(el("span", { class: "region-name", title: "what the COCO detector names this region" }, name));
  return div;
}

// The whole-sentence fragment (relation "<sentence>") is not a phrase of the sentence: its score
// enters S_kl against every image fragment, and the region it happens to score best with does not
// say where the sentence is (with `full` on Flickr8K dev that is a region, not the whole image, for
// 93 % of sentences: docs/results/alignment-dev.csv). So it is a label on the frame, not a box.
const SENTENCE_REL = "<sentence>";

// A fragment reads as its words ("dog jumps", "black dog": the API's `phrase`); its dependency
// notation (nsubj(jumps, dog)) is the label's title, shown on hover.
function fragmentText(m) {
  return m.relation === SENTENCE_REL ? "whole sentence" : (m.phrase || m.triplet);
}

function notation(m) {
  return m.relation === SENTENCE_REL ? "the whole-sentence fragment" : m.triplet;
}

// Relations of function words (determiners, auxiliaries, conjunctions, possessives ...): their
// triplets (det(dog, a)) say little about a picture, so a card folds them under "show all".
const FUNCTION_RELATIONS = new Set(["det", "predet", "aux", "auxpass", "cop", "cc", "punct", "mark", "case",
  "expl", "poss"]);
const TOP_LABELS = 3;  // content triplets labelled on a card before "show all"

// The alignment of a card, calmed: each triplet once (its best match: the same triplet of several
// descriptions is merged), best first; `top`: the first TOP_LABELS content triplets (and the
// whole-sentence fragment, a frame label), `folded`: the others. Items keep their index j (colour).
function calm(alignment) {
  const best = new Map();
  alignment.forEach((m, j) => {
    if (!(m.score > 0) || !located(m)) return;
    const seen = best.get(m.triplet);
    if (!seen || m.score > seen.m.score) best.set(m.triplet, { m, j });
  });
  const merged = [...best.values()].sort((a, b) => b.m.score - a.m.score);
  const content = merged.filter(({ m }) => m.relation !== SENTENCE_REL && !FUNCTION_RELATIONS.has(m.relation));
  const top = new Set([...content.slice(0, TOP_LABELS), ...merged.filter(({ m }) => m.relation === SENTENCE_REL)]);
  return { top: merged.filter((x) => top.has(x)), folded: merged.filter((x) => !top.has(x)) };
}

function items(alignment) {
  return alignment.map((m, j) => ({ m, j })).filter(({ m }) => m.score > 0 && located(m));
}

// Phrase evidence (the API's `found`): a fragment whose thing is not found in the picture has no region
// (`box` null) and is listed as not found, never drawn. A model without evidence gives `found` null.
function located(m) {
  return m.box !== null && m.box !== undefined;
}

function notFound(m) {
  return m.found !== null && m.found !== undefined && !located(m);
}

// "giraffe: not in this photo", one line per thing the result misses (the API's `missing`).
function missingLine(missing, where = "photo") {
  if (!missing || !missing.length) return null;
  return el("p", { class: "missing", title: "phrase evidence: these things are not found in the picture" },
    missing.map((w) => `${w}: not in this ${where}`).join(" · "));
}

// Matched fragments grouped by image fragment: one box per region, one label per triplet; the
// whole-sentence fragment as a frame label. `shown`: [{m, j}] (j: the fragment's colour).
function drawAlignment(overlay, shown, width, height) {
  overlay.replaceChildren();
  const groups = new Map();
  const frameLabels = [];
  shown.forEach(({ m, j }) => {
    const label = { text: `${fragmentText(m)} ${m.score.toFixed(2)}`, title: notation(m),
      colour: PALETTE[j % PALETTE.length] };
    if (m.relation === SENTENCE_REL) {
      frameLabels.push(label);
      return;
    }
    if (!groups.has(m.fragment)) groups.set(m.fragment, { box: m.box, labels: [], name: m.label || null });
    groups.get(m.fragment).labels.push(label);
  });
  for (const [fragment, g] of groups) {
    const div = boxDiv(g.box, width, height, g.labels, fragment === 0, g.name);
    div.dataset.fragment = String(fragment);  // the legend's items of this region point at it (linkHover)
    overlay.append(div);
  }
  if (frameLabels.length) {
    const title = "the whole sentence, scored against every fragment of the picture: not a region";
    overlay.append(el("div", { class: "frame-label", title },
      ...frameLabels.map((l) => el("span", { class: "label", title: l.title, style: { background: l.colour } }, l.text))));
  }
  return groups.size;
}

function figure(url, alt, width, height) {
  const img = el("img", { class: "result-img", src: url, alt, loading: "lazy" });
  const overlay = el("div", { class: "overlay" });
  const frame = el("div", { class: "frame", style: { aspectRatio: `${width} / ${height}` } }, img, overlay);
  return { frame, img, overlay };
}

// The fragments of a result with their scores; with `calmed` ({top, folded} of `calm`) the top ones
// are listed, the folded ones (and the unmatched) only under "show all", merged duplicates never.
function legend(alignment, calmed = null) {
  const list = el("ul", { class: "legend" });
  const top = new Set(calmed ? calmed.top.map(({ j }) => j) : []);
  const folded = new Set(calmed ? calmed.folded.map(({ j }) => j) : []);
  const kind = (m, j) => {
    if (notFound(m)) return "unmatched not-found";
    if (!calmed) return m.score > 0 ? "" : "unmatched";
    if (top.has(j)) return "";
    if (folded.has(j)) return "folded";
    return m.score > 0 ? "dup" : "folded unmatched";
  };
  alignment.forEach((m, j) => {
    const matched = m.score > 0 && located(m);
    const found = m.found !== null && m.found !== undefined ? ` · found ${m.found.toFixed(2)}` : "";
    list.append(el("li", { class: kind(m, j), tabindex: "0", title: notation(m),
      ...(matched && m.relation !== SENTENCE_REL ? { "data-fragment": String(m.fragment) } : {}) },
      el("span", { class: "swatch", style: { background: matched ? PALETTE[j % PALETTE.length] : "#ccc" } }),
      notFound(m) ? `${fragmentText(m)}: not found (${m.found.toFixed(2)})`
        : `${fragmentText(m)}  ${m.score.toFixed(3)}${found}`));
  });
  return list;
}

// What the service says of itself once ready (GET /readyz): whether results carry a relevance, and
// the cut-off the page starts with.
let serviceInfo = null;
async function info() {
  if (serviceInfo) return serviceInfo;
  try {
    const response = await fetch("/readyz");
    if (response.ok) serviceInfo = await response.json();
  } catch (err) { /* not ready: no relevance yet */ }
  return serviceInfo || { relevance: false };
}

// The filters of the form as request fields (only those set).
async function filters() {
  const out = {};
  const ready = await info();
  const cut = Number($("min-relevance").value);
  if (ready.relevance && cut > 0) out.min_relevance = cut;
  if ($("sort").value === "taken" && $("mode").value === "images" && ready.relevance) {
    out.sort = "taken";  // the API orders by date the results that reach a cut-off: 0 when none is set
    if (out.min_relevance === undefined) out.min_relevance = 0;
  }
  if ($("taken-after").value) out.taken_after = $("taken-after").value;
  if ($("taken-before").value) out.taken_before = $("taken-before").value;
  const [lat, lon, km] = ["near-lat", "near-lon", "near-km"].map((id) => $(id).value);
  if (lat !== "" || lon !== "" || km !== "") out.near = { lat: Number(lat), lon: Number(lon), km: Number(km) };
  return out;
}

async function searchImages(sentence, k, offset = 0) {
  const data = await api("/search/images", {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ sentence, k, offset, ...(await filters()) }),
  });
  const weaker = data.weaker || [];
  showImages(data.results, data.sentence, offset);
  if (!data.results.length && !weaker.length && offset === 0) {
    noMatch(data.reason || `nothing found for “${data.sentence}”`);
    moreButton(data.next_offset, (next) => searchImages(sentence, k, next));
    return data.reason || "no results";
  }
  if (!data.results.length && offset === 0) noGoodMatch(data.reason);
  if (weaker.length) {
    weakerLine(data.min_relevance);
    showImages(weaker, data.sentence, offset + data.results.length, true);
  }
  moreButton(data.next_offset, (next) => searchImages(sentence, k, next));
  const shown = offset + data.results.length;
  const cut = data.min_relevance !== null && data.min_relevance !== undefined
    ? `, relevance ≥ ${data.min_relevance}` : "";
  const below = weaker.length ? `, ${weaker.length} weaker` : "";
  return `${shown} images for “${data.sentence}”${below} (of ${data.considered} ranked${cut}) in ${data.took_ms.toFixed(0)} ms`;
}

// The line between the good matches and the weaker ones (the page's results under the cut-off: shown
// dimmed, each with what it misses; a page is never empty while the collection has ranked images).
function weakerLine(cut) {
  const results = $("results");
  if (results.querySelector(".weaker-line")) return;
  results.append(el("h3", { class: "weaker-line", role: "separator" },
    `weaker matches (relevance below ${Number(cut).toFixed(2)})`));
}

// No result reaches the cut-off, but the collection has ranked images: why, above the weaker ones.
function noGoodMatch(reason) {
  $("results").append(el("p", { class: "no-match", role: "status" }, reason || "no good match"));
  document.body.dataset.result = "nomatch";
}

// The "no good match" answer: an empty list and why, instead of a grid.
function noMatch(reason) {
  $("results").replaceChildren(el("p", { class: "no-match", role: "status" }, reason,
    el("br"), "Lower the relevance cut-off or widen the filters to see weaker matches."));
  document.body.dataset.result = "nomatch";
}

function relevanceBar(relevance) {
  const value = Math.max(0, Math.min(1, relevance));
  return el("div", { class: "relevance", title: "how likely a person would call this a match (0 to 1)" },
    el("div", { class: "track" }, el("div", { class: "fill", style: { width: `${(100 * value).toFixed(1)}%` } })),
    el("span", { class: "value" }, value.toFixed(2)));
}

// "more results" under the grid while the ranking has another page (next_offset), else nothing;
// load(next) fetches and shows that page and returns the status line.
function moreButton(nextOffset, load) {
  const old = $("more");
  if (old) old.remove();
  if (nextOffset === null || nextOffset === undefined) return;
  const button = el("button", { type: "button", id: "more" }, "more results");
  button.addEventListener("click", async () => {
    button.disabled = true;
    const status = $("search-status");
    try {
      status.textContent = await load(nextOffset);
    } catch (err) {
      status.textContent = err.message;
      status.classList.add("error");
    }
  });
  $("results").after(button);
}

// The file of a result: its path as the index holds it (relative to the collection folder), a button
// that copies it and a link that opens the original.
function fileLine(hit, url) {
  const path = hit.path || hit.name;
  const copy = el("button", { type: "button", class: "copy", title: "copy the path" }, "copy path");
  copy.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(path);
      copy.textContent = "copied";
    } catch (err) {
      copy.textContent = "select the path to copy it";  // the clipboard needs a secure context
    }
  });
  return el("div", { class: "file" }, el("code", { class: "path", title: path }, path), copy,
    el("a", { class: "open", href: url, target: "_blank", rel: "noopener" }, "open original"));
}

// Result cards: the thumbnail with its alignment, and the "why?" (POST /explain, when there is a
// sentence) and "more like this" (POST /search/similar) buttons.
function showImages(hits, sentence, offset = 0, weaker = false) {
  const results = $("results");
  if (offset === 0 && !weaker) results.replaceChildren();
  hits.forEach((hit, i) => {
    const rank = offset + i;
    const { frame, overlay } = figure(hit.thumbnail, hit.name, hit.width, hit.height);  // boxes: original's pixels
    const { top, folded } = calm(hit.alignment);
    drawAlignment(overlay, top, hit.width, hit.height);
    const why = el("button", { type: "button", class: "why" }, "why?");
    const like = el("button", { type: "button", class: "like" }, "more like this");
    const caption = el("figcaption", {}, el("strong", {}, `#${rank + 1} `), `${hit.name} · `,
      sentence ? `S = ${hit.score.toFixed(4)}` : `cosine ${hit.score.toFixed(3)}`,
      hit.taken ? ` · ${hit.taken.slice(0, 10)}` : "");
    const missing = missingLine(hit.missing);
    const card = el("figure", { class: weaker ? "card weaker" : "card", "data-id": hit.id }, frame, caption,
      fileLine(hit, hit.url),
      ...(hit.relevance !== null && hit.relevance !== undefined ? [relevanceBar(hit.relevance)] : []),
      ...(missing ? [missing] : []),
      legend(hit.alignment, { top, folded }), el("div", { class: "actions" }, why, like));
    if (folded.length) {
      const toggle = el("button", { type: "button", class: "show-all" }, `show all (${folded.length} more)`);
      toggle.addEventListener("click", () => {
        const all = card.classList.toggle("all");
        drawAlignment(overlay, all ? [...top, ...folded] : top, hit.width, hit.height);
        toggle.textContent = all ? "show fewer" : `show all (${folded.length} more)`;
      });
      card.querySelector(".legend").after(toggle);
    }
    if (sentence) why.addEventListener("click", () => explain(card, hit.id, sentence));
    else why.hidden = true;
    like.addEventListener("click", () => {
      history.replaceState(null, "", `?${new URLSearchParams({ like: hit.id, k: $("k").value })}`);
      moreLike(hit.id, hit.name);
    });
    results.append(card);
  });
}

// Every fragment pair of one result: v·s, whether it clears the threshold, its share of S_kl.
async function explain(card, imageId, sentence) {
  const old = card.querySelector(".explain");
  if (old) { old.remove(); return; }
  const box = el("div", { class: "explain", role: "region", "aria-label": "why this image" }, "explaining…");
  card.append(box);
  try {
    const e = await api("/explain", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ image_id: imageId, sentence }),
    });
    const pairs = [...e.pairs].sort((a, b) => b.contribution - a.contribution || b.score - a.score).slice(0, 12);
    const rows = pairs.map((p) => el("tr", { class: p.cleared ? "cleared" : "below" },
      el("td", { title: p.triplet }, fragmentText(p)), el("td", {}, p.fragment === 0 ? "whole image" : `region ${p.fragment}${p.label ? ` (${p.label})` : ""}`),
      el("td", {}, p.score.toFixed(3)), el("td", {}, p.contribution.toFixed(5))));
    box.replaceChildren(
      el("p", {}, `S = ${e.score.toFixed(4)}, rank ${e.rank} of ${e.images}`,
        e.scope === "candidates" ? " images the index recalls for the sentence" : "",
        e.recalled ? "; " : " (the index does not recall it: a search does not return it); ",
        `${e.pairs.filter((p) => p.cleared).length} of ${e.pairs.length} pairs clear the threshold (v·s > 0)`),
      ...(e.missing && e.missing.length ? [missingLine(e.missing)] : []),
      el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "fragment"), el("th", {}, "region"),
        el("th", {}, "v·s"), el("th", {}, "share of S"))), el("tbody", {}, ...rows)));
  } catch (err) {
    box.textContent = err.message;
    box.classList.add("error");
  }
}

function moreLike(imageId, name) {
  const form = new FormData();
  form.append("image_id", String(imageId));
  return runSimilar(form, name);
}

// POST /search/similar with `form` (an image_id or a file); the results replace the search results.
async function runSimilar(form, name) {
  const status = $("search-status");
  status.textContent = "searching…";
  status.classList.remove("error");
  document.body.dataset.state = "searching";
  form.append("k", String(Number($("k").value) || 8));
  try {
    const data = await api("/search/similar", { method: "POST", body: form });
    showImages(data.results, null);
    moreButton(null);
    const said = data.described_by.length ? ` (described as “${data.described_by[0].text}”)` : "";
    status.textContent = `${data.results.length} images like ${name}${said} in ${data.took_ms.toFixed(0)} ms`;
    document.body.dataset.state = "done";
  } catch (err) {
    status.textContent = err.message;
    status.classList.add("error");
    document.body.dataset.state = "error";
  }
}

async function searchRegions(phrase, k, offset = 0) {
  const data = await api("/search/fragments", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ phrase, k, offset }),
  });
  const results = $("results");
  if (offset === 0) results.replaceChildren();
  moreButton(data.next_offset, (next) => searchRegions(phrase, k, next));
  data.results.forEach((hit, i) => {
    const rank = offset + i;
    // the thumbnail, the box drawn in the original's pixels (width, height)
    const { frame, overlay } = figure(hit.thumbnail, hit.name, hit.width, hit.height);
    const label = [{ text: `${data.query} ${hit.score.toFixed(2)}`, colour: PALETTE[0] }];
    overlay.replaceChildren(boxDiv(hit.box, hit.width, hit.height, label, hit.fragment === 0, hit.label || null));
    results.append(el("figure", { class: "card", "data-id": hit.image_id }, frame,
      el("figcaption", {}, el("strong", {}, `#${rank + 1} `), `${hit.name} · region ${hit.fragment}${hit.label ? ` (${hit.label})` : ""}`),
      fileLine(hit, hit.url)));
  });
  const shown = offset + data.results.length;
  return `${shown} regions for “${data.query}” (of ${data.considered} matching) in ${data.took_ms.toFixed(0)} ms`;
}

async function runSearch() {
  const query = $("q").value.trim();
  const k = Number($("k").value) || 8;
  const status = $("search-status");
  if (!query) return;
  document.body.dataset.state = "searching";
  delete document.body.dataset.result;
  status.textContent = "searching…";
  status.classList.remove("error");
  try {
    status.textContent = $("mode").value === "regions" ? await searchRegions(query, k) : await searchImages(query, k);
    document.body.dataset.state = "done";
  } catch (err) {
    $("results").replaceChildren();
    status.textContent = err.message;
    status.classList.add("error");
    document.body.dataset.state = "error";
  }
}

async function runAnnotate(file, k) {
  const status = $("annotate-status");
  const out = $("annotation");
  status.textContent = "reading the image…";
  status.classList.remove("error");
  const form = new FormData();
  form.append("file", file);
  form.append("k", String(k));
  try {
    const data = await api("/annotate", { method: "POST", body: form });
    const url = URL.createObjectURL(file);
    const { frame, overlay } = figure(url, file.name, data.width, data.height);
    const list = el("ol", { class: "sentences" });
    const all = [...data.results, ...(data.weaker || [])];
    const select = (i) => {
      drawAlignment(overlay, items(all[i].alignment), data.width, data.height);
      list.querySelectorAll("li").forEach((li, j) => li.classList.toggle("selected", i === j));
    };
    all.forEach((hit, i) => {
      if (i === data.results.length && i > 0) {
        list.append(el("li", { class: "weaker-line", role: "separator" }, "weaker matches"));
      }
      const missing = missingLine(hit.missing);
      const item = el("li", { tabindex: "0", class: i >= data.results.length ? "weaker" : "" },
        el("span", { class: "sentence" }, hit.text),
        el("span", { class: "score" }, ` S = ${hit.score.toFixed(4)}`), ...(missing ? [missing] : []),
        legend(hit.alignment));
      item.addEventListener("click", () => select(i));
      item.addEventListener("keydown", (e) => { if (e.key === "Enter") select(i); });
      list.append(item);
    });
    out.replaceChildren(el("div", { class: "annotated" }, el("figure", { class: "card" }, frame), list));
    if (all.length) select(0);
    status.textContent = `${data.results.length} sentences in ${data.took_ms.toFixed(0)} ms (click one to see its regions)`;
  } catch (err) {
    out.replaceChildren();
    status.textContent = err.message;
    status.classList.add("error");
  }
}

// The form's filters <-> the address: ?min_relevance=, taken_after=, taken_before=, near=lat,lon,km
const FILTER_PARAMS = [["min_relevance", "min-relevance"], ["taken_after", "taken-after"], ["taken_before", "taken-before"]];

$("search-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const params = new URLSearchParams({ q: $("q").value, mode: $("mode").value, k: $("k").value });
  if ($("sort").value !== "score") params.set("sort", $("sort").value);
  for (const [param, id] of FILTER_PARAMS) if ($(id).value) params.set(param, $(id).value);
  const near = ["near-lat", "near-lon", "near-km"].map((id) => $(id).value);
  if (near.some((v) => v !== "")) params.set("near", near.join(","));
  history.replaceState(null, "", `?${params}`);
  runSearch();
});

$("annotate-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const file = $("file").files[0];
  if (file) runAnnotate(file, Number($("ak").value) || 5);
});

// ?q=... runs the search on load, ?like=<image id> "more like this" (links and headless checks use them).
(async function fromQuery() {
  const params = new URLSearchParams(location.search);
  if (params.get("mode") === "regions") $("mode").value = "regions";
  if (params.get("k")) $("k").value = params.get("k");
  if (params.get("sort") === "taken") $("sort").value = "taken";
  const ready = await info();
  const cut = $("min-relevance");
  cut.disabled = !ready.relevance;
  if (!ready.relevance) cut.title = "this model has no relevance scale";
  else cut.value = String(ready.default_min_relevance);
  for (const [param, id] of FILTER_PARAMS) if (params.get(param) !== null) $(id).value = params.get(param);
  const near = (params.get("near") || "").split(",");
  if (near.length === 3) ["near-lat", "near-lon", "near-km"].forEach((id, i) => { $(id).value = near[i]; });
  if ([...FILTER_PARAMS.slice(1).map(([p]) => p), "near"].some((p) => params.get(p))) $("filters").open = true;
  if (params.get("q")) {
    $("q").value = params.get("q");
    runSearch();
  } else if (/^\d+$/.test(params.get("like") || "")) {
    moreLike(Number(params.get("like")), `image ${params.get("like")}`);
  }
})();

// While the service prepares (GET /readyz answers 503 with its progress) say how far it got, and poll.
function describeProgress(body) {
  const p = body && body.progress;
  if (!p) return body && body.error ? body.error.message : "The service is loading.";
  let text = `Preparing: ${p.stage}${p.detail ? ` (${p.detail})` : ""}`;
  if (p.total) text += ` — ${p.step || "step"} ${p.done} / ${p.total}`;
  if (p.eta_seconds !== null && p.eta_seconds !== undefined) {
    text += `, about ${Math.max(1, Math.round(p.eta_seconds / 60))} min left in this step`;
  }
  if (p.stages_left && p.stages_left.length) text += `; then ${p.stages_left.join(", ")}`;
  if (body.serving && body.serving.length) text += ". Searches already work.";
  return text + ".";
}

(async function watchReadiness() {
  const banner = $("preparing");
  for (;;) {
    let response = null;
    let body = null;
    try {
      response = await fetch("/readyz");
      body = await response.json().catch(() => null);
    } catch (err) {
      response = null;
    }
    if (response && response.ok) {
      banner.hidden = true;
      document.body.dataset.service = "ready";
      return;
    }
    banner.hidden = false;
    document.body.dataset.service = body && body.status ? body.status : "unreachable";
    banner.textContent = response ? describeProgress(body) : "The service does not answer.";
    if (body && body.status === "failed") return;
    await new Promise((resolve) => setTimeout(resolve, 5000));
  }
})();

// Hovering (or focusing) a triplet of a legend lights up its region, hovering a region its triplets.
function linkHover(container) {
  const light = (fragment, on) => {
    if (fragment === undefined) return;
    container.querySelectorAll(`[data-fragment="${fragment}"]`).forEach((n) => n.classList.toggle("hot", on));
  };
  for (const type of ["mouseover", "focusin"]) {
    container.addEventListener(type, (e) => {
      const node = e.target.closest("[data-fragment]");
      if (node) light(node.dataset.fragment, true);
    });
  }
  for (const type of ["mouseout", "focusout"]) {
    container.addEventListener(type, (e) => {
      const node = e.target.closest("[data-fragment]");
      if (node) light(node.dataset.fragment, false);
    });
  }
}
linkHover($("results"));
linkHover($("annotation"));

// An image dropped anywhere on the page, or pasted, is described (POST /annotate); "more like this"
// then finds images like it (POST /search/similar with the upload).
function imageFile(items) {
  for (const item of items || []) {
    const file = item instanceof File ? item : item.kind === "file" ? item.getAsFile() : null;
    if (file && file.type.startsWith("image/")) return file;
  }
  return null;
}

let lastUpload = null;
function takeUpload(file) {
  lastUpload = file;
  $("similar-upload").disabled = false;
  runAnnotate(file, Number($("ak").value) || 5);
}

document.addEventListener("dragover", (e) => {
  if ([...e.dataTransfer.types].includes("Files")) {
    e.preventDefault();
    document.body.classList.add("dropping");
  }
});
document.addEventListener("dragleave", (e) => {
  if (e.target === document.documentElement || e.target === document.body) document.body.classList.remove("dropping");
});
document.addEventListener("drop", (e) => {
  document.body.classList.remove("dropping");
  const file = imageFile(e.dataTransfer.files);
  if (!file) return;
  e.preventDefault();
  takeUpload(file);
});
document.addEventListener("paste", (e) => {
  const file = imageFile(e.clipboardData && e.clipboardData.items);
  if (!file) return;
  e.preventDefault();
  takeUpload(file);
});
$("file").addEventListener("change", () => {
  lastUpload = $("file").files[0] || null;
  $("similar-upload").disabled = !lastUpload;
});

$("similar-upload").addEventListener("click", () => {
  if (!lastUpload) return;
  const form = new FormData();
  form.append("file", lastUpload);
  runSimilar(form, lastUpload.name);
});
