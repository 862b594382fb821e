// What every widget's front-end module uses; put before each module's own code (the widgets'
// `_esm` is this file followed by the module: see metaclaw/notebook/widgets/base.py `esm`).

// h("div", {class: "x", onclick: fn}, child, ...): a DOM element with attributes, listeners
// (on<event>) and children (nodes, or text); null, undefined and false are left out.
function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}
