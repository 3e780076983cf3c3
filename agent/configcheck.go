package agent

import (
	"encoding/json"
	"path/filepath"
	"reflect"

	"github.com/tokenbroker/tokenbroker/api/schema"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// CheckConfigDocument checks an agent config document (YAML decoded into
// any) read from path, as "tokenbroker config validate" does: its shape
// and every rule of the loader, all problems at once. No problem means
// LoadConfig accepts the file.
func CheckConfigDocument(path string, doc any) []apiv1.FieldError {
	var sc schema.Checker
	clean := sc.Check("", doc, reflect.TypeFor[Config]())
	problems := sc.Problems
	js, err := json.Marshal(clean)
	if err != nil {
		return append(problems, apiv1.FieldError{Detail: err.Error()})
	}
	_, err = ParseConfig(js, filepath.Dir(path))
	problems = append(problems, sc.Without(schema.LoaderProblems(err))...)
	if len(problems) == 0 {
		if _, err := LoadConfig(path); err != nil {
			problems = append(problems, apiv1.FieldError{Detail: err.Error()})
		}
	}
	return problems
}
