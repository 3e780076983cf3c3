package config

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"reflect"
	"strings"

	"github.com/tokenbroker/tokenbroker/api/schema"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// CheckDocument checks an agent config document (YAML decoded into
// any) read from path, as "tokenbroker config validate" does: its shape
// and every rule of the loader, all problems at once. No problem means
// Load accepts the file.
func CheckDocument(path string, doc any) []apiv1.FieldError {
	var sc schema.Checker
	clean := sc.Check("", doc, reflect.TypeFor[Config]())
	problems := sc.Problems
	js, err := json.Marshal(clean)
	if err != nil {
		return append(problems, apiv1.FieldError{Detail: err.Error()})
	}
	_, err = Parse(js, filepath.Dir(path))
	problems = append(problems, sc.Without(schema.LoaderProblems(err))...)
	if len(problems) == 0 {
		if _, err := Load(path); err != nil {
			problems = append(problems, apiv1.FieldError{Detail: err.Error()})
		}
	}
	return problems
}

// Notes are what "tokenbroker config validate" says of a valid agent
// config besides its problems: what the broker may refuse that the file
// cannot tell. (Lenient decoding: the problems are CheckDocument's.)
func Notes(doc any) []apiv1.FieldError {
	js, err := json.Marshal(doc)
	if err != nil {
		return nil
	}
	var c Config
	if json.Unmarshal(js, &c) != nil {
		return nil
	}
	var notes []apiv1.FieldError
	for i, t := range c.Targets {
		if len(t.Request.Audiences) > 0 {
			notes = append(notes, apiv1.FieldError{
				Field: fmt.Sprintf("targets[%d].request.audiences", i),
				Detail: fmt.Sprintf("the broker answers 403 to a request naming audiences (%s) unless its grant lists every one "+
					"in grants[].audiences (docs/policy.md, Audiences); leave them out for a token for the API server",
					strings.Join(t.Request.Audiences, ", ")),
			})
		}
		if t.Request.Access == apiv1.AccessGateway {
			notes = append(notes, apiv1.FieldError{
				Field: fmt.Sprintf("targets[%d].request.access", i),
				Detail: "the broker answers 403 unless a grant with access: gateway allows this request, and 422 unless it runs " +
					"a lease gateway (serve --gateway-address); the outputs then point at the gateway, not at the API server",
			})
		}
	}
	return notes
}
