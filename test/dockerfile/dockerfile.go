// Package dockerfile reads the repository's Dockerfile as far as the tests
// need: its stages, the Debian packages the runtime stage installs, the go
// builds of the builder stage and what the runtime stage copies. test/chart
// checks the Dockerfile with it; test/cluster builds the same image from it
// without a registry or an image builder.
package dockerfile

import (
	"bufio"
	"fmt"
	"os"
	"path"
	"slices"
	"strings"
)

// Stage is one FROM ... [AS name] and its instructions.
type Stage struct {
	From, Name string
	Instrs     []Instr
}

// Instr is one instruction, continuation lines joined.
type Instr struct {
	Line      int
	Cmd, Args string
}

// Parse splits a Dockerfile into stages of instructions, joining
// continuation lines and dropping comments.
func Parse(file string) ([]Stage, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var stages []Stage
	var cur strings.Builder
	var perr error
	start, n := 0, 0
	flush := func() {
		text := strings.TrimSpace(cur.String())
		cur.Reset()
		if text == "" {
			return
		}
		cmd, args, _ := strings.Cut(text, " ")
		in := Instr{Line: start, Cmd: strings.ToUpper(cmd), Args: strings.TrimSpace(args)}
		if in.Cmd == "FROM" {
			fields := strings.Fields(in.Args)
			var s Stage
			for i := 0; i < len(fields); i++ {
				switch {
				case strings.HasPrefix(fields[i], "--"):
				case strings.EqualFold(fields[i], "AS") && i+1 < len(fields):
					s.Name = fields[i+1]
					i++
				case s.From == "":
					s.From = fields[i]
				}
			}
			stages = append(stages, s)
		}
		if len(stages) == 0 {
			if in.Cmd != "ARG" && perr == nil {
				perr = fmt.Errorf("%s:%d: %s before the first FROM", file, in.Line, in.Cmd)
			}
			return
		}
		stages[len(stages)-1].Instrs = append(stages[len(stages)-1].Instrs, in)
	}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		n++
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "#") {
			continue // comment, also inside a continued instruction
		}
		if cur.Len() == 0 {
			if trimmed == "" {
				continue
			}
			start = n
		}
		if body, ok := strings.CutSuffix(strings.TrimRight(line, " \t"), "\\"); ok {
			cur.WriteString(body + " ")
			continue
		}
		cur.WriteString(line)
		flush()
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	flush()
	if perr != nil {
		return nil, perr
	}
	if len(stages) == 0 {
		return nil, fmt.Errorf("%s has no FROM", file)
	}
	return stages, nil
}

// ShellWords splits a RUN line into words and shell operators.
func ShellWords(s string) []string {
	var words []string
	for _, w := range strings.Fields(s) {
		for w != "" {
			i := strings.IndexAny(w, ";&|")
			if i < 0 {
				words = append(words, w)
				break
			}
			if i > 0 {
				words = append(words, w[:i])
			}
			j := i + 1
			for j < len(w) && strings.ContainsRune(";&|", rune(w[j])) {
				j++
			}
			words = append(words, w[i:j])
			w = w[j:]
		}
	}
	return words
}

// SplitCommands splits shell words at operators into simple commands.
func SplitCommands(words []string) [][]string {
	var cmds [][]string
	var cur []string
	for _, w := range words {
		if strings.ContainsAny(w, ";&|") {
			cmds = append(cmds, cur)
			cur = nil
			continue
		}
		cur = append(cur, w)
	}
	return append(cmds, cur)
}

// AptInstalls returns the packages a stage installs with apt-get/apt install,
// and whether every such install passes --no-install-recommends.
func AptInstalls(s Stage) (pkgs []string, noRecommends bool) {
	noRecommends = true
	for _, in := range s.Instrs {
		if in.Cmd != "RUN" {
			continue
		}
		words := ShellWords(in.Args)
		for i := 0; i+1 < len(words); i++ {
			if (words[i] != "apt-get" && words[i] != "apt") || words[i+1] != "install" {
				continue
			}
			seen := false
			for j := i + 2; j < len(words); j++ {
				w := words[j]
				if strings.ContainsAny(w, ";&|") {
					break
				}
				if w == "--no-install-recommends" {
					seen = true
				}
				if strings.HasPrefix(w, "-") {
					continue
				}
				name, _, _ := strings.Cut(w, "=") // pkg=version
				pkgs = append(pkgs, name)
			}
			noRecommends = noRecommends && seen
		}
	}
	return pkgs, noRecommends
}

// GoBuild is one `go build` of a RUN instruction.
type GoBuild struct {
	Line int
	// Env are the VAR=value words before `go`; Flags the words between
	// `build` and the package; Out the -o argument; Package the last word.
	Env, Flags   []string
	Out, Package string
}

// GoBuilds returns the go builds of the stages (the builder stages).
func GoBuilds(stages []Stage) []GoBuild {
	var builds []GoBuild
	for _, s := range stages {
		for _, in := range s.Instrs {
			if in.Cmd != "RUN" {
				continue
			}
			for _, cmd := range SplitCommands(ShellWords(in.Args)) {
				i := slices.Index(cmd, "build")
				if i < 1 || cmd[i-1] != "go" || len(cmd) < i+2 {
					continue
				}
				b := GoBuild{Line: in.Line, Env: cmd[:i-1], Flags: cmd[i+1 : len(cmd)-1], Package: cmd[len(cmd)-1]}
				if j := slices.Index(cmd, "-o"); j >= 0 && j+1 < len(cmd) {
					b.Out = cmd[j+1]
				}
				builds = append(builds, b)
			}
		}
	}
	return builds
}

// Copies returns what a stage's COPY instructions install: destination
// path → source path (in the build context, or in the stage named by --from).
func Copies(s Stage) map[string]string {
	installed := map[string]string{}
	for _, in := range s.Instrs {
		if in.Cmd != "COPY" {
			continue
		}
		var words []string
		for _, w := range strings.Fields(in.Args) {
			if !strings.HasPrefix(w, "--") {
				words = append(words, w)
			}
		}
		if len(words) < 2 {
			continue
		}
		dst := words[len(words)-1]
		for _, src := range words[:len(words)-1] {
			if strings.HasSuffix(dst, "/") || len(words) > 2 {
				installed[path.Join(dst, path.Base(src))] = src
			} else {
				installed[dst] = src
			}
		}
	}
	return installed
}

// Entrypoint returns the exec-form ENTRYPOINT of a stage, if any.
func Entrypoint(s Stage) []string {
	var ep []string
	for _, in := range s.Instrs {
		if in.Cmd != "ENTRYPOINT" {
			continue
		}
		body := strings.TrimSpace(in.Args)
		if !strings.HasPrefix(body, "[") || !strings.HasSuffix(body, "]") {
			continue
		}
		ep = nil
		for _, w := range strings.Split(strings.Trim(body, "[]"), ",") {
			ep = append(ep, strings.Trim(strings.TrimSpace(w), `"`))
		}
	}
	return ep
}
