package policy

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"reflect"

	"github.com/tokenbroker/tokenbroker/api/schema"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// CheckDocument checks a policy document (YAML decoded into any)
// read from path, as "tokenbroker config validate" does: its shape, every
// rule of ParsePolicy and the CA bundle it names, all problems at once.
// Notes are what could not be checked here (a caFile that exists only
// where the broker runs). No problem means LoadFile accepts the file.
func CheckDocument(path string, doc any) (problems, notes []apiv1.FieldError) {
	var sc schema.Checker
	clean := sc.Check("", doc, reflect.TypeFor[Policy]())
	problems = sc.Problems
	js, err := json.Marshal(clean)
	if err != nil {
		return append(problems, apiv1.FieldError{Detail: err.Error()}), nil
	}
	_, err = Parse(js)
	problems = append(problems, sc.Without(schema.LoaderProblems(err))...)

	// The CA bundle, as LoadFile reads it. (Lenient decoding: the
	// shape problems are reported above.)
	var p Policy
	_ = json.Unmarshal(js, &p)
	caChecked := true
	switch {
	case p.Cluster.CAFile != "" && p.Cluster.CAData != "":
	case p.Cluster.CAFile != "":
		caFile := p.Cluster.CAFile
		if !filepath.IsAbs(caFile) {
			caFile = filepath.Join(filepath.Dir(path), caFile)
		}
		data, err := pki.ReadFileLimit(caFile, maxPolicyBytes)
		switch {
		case errors.Is(err, fs.ErrNotExist) || errors.Is(err, fs.ErrPermission):
			caChecked = false
			notes = append(notes, apiv1.FieldError{Field: "cluster.caFile", Detail: fmt.Sprintf("not checked: %v; the broker reads it where it runs", err)})
		case err != nil:
			problems = append(problems, apiv1.FieldError{Field: "cluster.caFile", Detail: err.Error()})
		default:
			if err := checkCABundle(data); err != nil {
				problems = append(problems, apiv1.FieldError{Field: "cluster.caFile", Detail: fmt.Sprintf("%s: %v", caFile, err)})
			}
		}
	case p.Cluster.CAData != "":
		if err := checkCABundle([]byte(p.Cluster.CAData)); err != nil {
			problems = append(problems, apiv1.FieldError{Field: "cluster.caData", Detail: err.Error()})
		}
	}
	// The broker's own loader has the last word, so that "valid" means
	// "serve would load it".
	if len(problems) == 0 && caChecked {
		if _, err := LoadFile(path); err != nil {
			problems = append(problems, apiv1.FieldError{Detail: err.Error()})
		}
	}
	return problems, notes
}
